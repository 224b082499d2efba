"""A second pass through the graph of a patched model's loss: liger-kernel's fused losses rescale their saved
gradient in place, so such a pass is refused with a clear error before any gradient changes; the vocab-chunked loss
recomputes in its backward and gives the same gradient every time."""

import pytest
import torch

from liger_dspine import apply_liger_kernel_to_deepseek_v3
from liger_dspine.modules.swiglu import LigerSwiGLUMLP
from tiny_models import build_model
from tiny_models import random_batch
from tiny_models import tiny_deepseek_v3_config

REFUSED = "already back-propagated once"


def patched_model(**options):
    config = tiny_deepseek_v3_config()
    model = build_model(config).train()
    apply_liger_kernel_to_deepseek_v3(model=model, **options)
    return model, config


def grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("options", [{}, {"cross_entropy": True, "fused_linear_cross_entropy": False}])
def test_second_backward_is_refused_before_anything_changes(options):
    model, config = patched_model(**options)
    input_ids, labels = random_batch(config)
    loss = model(input_ids, labels=labels).loss
    loss.backward(retain_graph=True)
    first = grads(model)
    with pytest.raises(RuntimeError, match=REFUSED):
        loss.backward()
    after = grads(model)
    assert after.keys() == first.keys() and all(torch.equal(after[n], g) for n, g in first.items())


def test_autograd_grad_then_backward_is_refused_and_returned_tensors_stay():
    model, config = patched_model()
    input_ids, labels = random_batch(config)
    params = [p for p in model.parameters() if p.requires_grad]
    loss = model(input_ids, labels=labels).loss
    returned = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    kept = [None if g is None else g.clone() for g in returned]
    with pytest.raises(RuntimeError, match=REFUSED):
        loss.backward()
    assert all(g is None or torch.equal(g, k) for g, k in zip(returned, kept))
    assert all(p.grad is None for p in params)


def test_an_upstream_gradient_of_one_keeps_repeated_passes_exact():
    """num_items_in_batch=1 makes the kernel's upstream gradient exactly 1: nothing is rescaled, passes repeat.
    (swiglu=False: the fused SwiGLU MLP's own backward runs once; see the last test.)"""
    model, config = patched_model(swiglu=False)
    input_ids, labels = random_batch(config)
    loss = model(input_ids, labels=labels, num_items_in_batch=1).loss
    loss.backward(retain_graph=True)
    first = grads(model)
    loss.backward()
    assert all(torch.equal(p.grad, 2 * first[n]) for n, p in model.named_parameters() if n in first)


def test_vocab_chunked_loss_gives_the_same_gradient_every_pass():
    model, config = patched_model(vocab_chunked_lce=True, swiglu=False)
    input_ids, labels = random_batch(config)
    loss = model(input_ids, labels=labels).loss
    head = model.lm_head.weight
    (first,) = torch.autograd.grad(loss, head, retain_graph=True)
    (second,) = torch.autograd.grad(loss, head, retain_graph=True)
    assert torch.equal(first, second) and first.abs().sum() > 0


def test_swiglu_second_backward_message_names_what_to_do():
    config = tiny_deepseek_v3_config()
    torch.manual_seed(0)
    mlp = LigerSwiGLUMLP(config)
    x = torch.randn(2, 5, config.hidden_size, requires_grad=True)
    out = mlp(x).sum()
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="LigerSwiGLUMLP.*run the forward again, or patch with swiglu=False"):
        out.backward()
