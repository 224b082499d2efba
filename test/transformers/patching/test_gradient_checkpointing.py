"""Gradient checkpointing through a patched model: transformers' ``GradientCheckpointingLayer`` checkpoints a
layer's ``forward`` only when it is the class's own ``forward``, so a replacement layer class (DeepSeek-V4's decoder
layer, whose forward the patch dresses with the native signature) must still checkpoint. With checkpointing on,
each decoder layer hands its forward to the checkpoint function, and the loss and every gradient equal the run
without it. fp32 on a CPU through Triton's interpreter."""

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tiny_family import CASES  # noqa: E402


def loss_and_grads(model, input_ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", ["deepseek_v4"])
@pytest.mark.parametrize("level", ["class", "instance"])
def test_patched_layers_checkpoint_and_keep_the_gradients(model_type, level):
    from transformers.modeling_layers import GradientCheckpointingLayer

    case = CASES[model_type]
    case.modeling_or_skip()
    native = case.build().train()
    if level == "class":
        case.apply_fn()()
        try:
            model = case.build().train()
        finally:
            case.revert_fn()()
        model.load_state_dict(native.state_dict())
    else:
        model = copy.deepcopy(native)
        case.apply_fn()(model=model)
    input_ids = torch.randint(0, case.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    expected_loss, expected = loss_and_grads(model, input_ids)

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    assert layers and any(type(m).__name__.startswith("Liger") for m in model.modules())
    handed = []
    for layer in layers:
        checkpoint = layer._gradient_checkpointing_func

        def counted(function, *args, checkpoint=checkpoint, **kwargs):
            handed.append(function)
            return checkpoint(function, *args, **kwargs)

        layer._gradient_checkpointing_func = counted
    loss, grads = loss_and_grads(model, input_ids)
    assert len(handed) == len(layers)  # every layer's forward went through the checkpoint
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
