"""The default patch under DeepSpeed ZeRO-3 through transformers' ``Trainer`` on two gloo ranks, against one plain
process taking one SGD step on the whole batch.

ZeRO-3 partitions every parameter across the ranks and gathers a module's parameters around that module's own call.
The fused loss and the fused SwiGLU down projection read ``lm_head.weight`` / ``down_proj.weight`` without the
native call, so they run inside those modules' hooks (``parallel_state.call_through_hooks``): they must run (their
calls are counted), and one SGD step of learning rate 1 must move every parameter as the whole-batch gradient does.
The patch is applied at class level before the model is built, and through ``register_with_liger()`` with
``Trainer(use_liger_kernel=True)``. fp32; 1e-5 covers the reordered reductions.
"""

import pytest
import torch

from one_process_reference import FP32
from one_process_reference import batch
from spawned_ranks import run_on_gloo_ranks
from tiny_models import build_model
from tiny_models import tiny_deepseek_v3_config

pytest.importorskip("deepspeed", reason="DeepSpeed (a test extra)")
pytestmark = pytest.mark.slow  # spawned gloo ranks loading a model each: a minute or more
BATCH = 4
ZERO3 = {
    "zero_optimization": {"stage": 3},
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_allow_untested_optimizer": True,
}


def _batch(config):
    return batch(config, BATCH)


def _train_one_step(path, order, folder):
    import os

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    from accelerate import PartialState

    PartialState(backend="gloo")
    import deepspeed
    from transformers import DeepseekV3ForCausalLM
    from transformers import Trainer
    from transformers import TrainingArguments

    import liger_dspine
    from liger_dspine.modules import causal_lm_forward
    from liger_dspine.modules import swiglu

    calls = {"loss": 0, "down": 0}
    loss_fn, down_fn = causal_lm_forward._fused_linear_ce, swiglu.liger_swiglu_down
    causal_lm_forward._fused_linear_ce = lambda *a: calls.__setitem__("loss", calls["loss"] + 1) or loss_fn(*a)
    swiglu.liger_swiglu_down = lambda *a, **k: calls.__setitem__("down", calls["down"] + 1) or down_fn(*a, **k)
    if order == "class":
        liger_dspine.apply_liger_kernel_to_deepseek_v3()
    elif order == "register":
        liger_dspine.register_with_liger()
    try:
        args = TrainingArguments(
            output_dir=os.path.join(folder, order),
            per_device_train_batch_size=BATCH // 2,
            max_steps=1,
            learning_rate=1.0,
            lr_scheduler_type="constant",
            optim="sgd",
            weight_decay=0.0,
            max_grad_norm=0.0,
            deepspeed=ZERO3,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            use_liger_kernel=order == "register",
            dataloader_drop_last=True,
        )
        model = DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32)
        input_ids, labels = _batch(model.config)
        rows = [{"input_ids": input_ids[i], "labels": labels[i]} for i in range(BATCH)]
        trainer = Trainer(model=model, args=args, train_dataset=rows)
        trainer.train()
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            params = {name: p.detach().clone() for name, p in model.named_parameters()}
        liger = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.startswith("Liger")})
        return {"params": params, "calls": calls, "liger": liger}
    finally:
        causal_lm_forward._fused_linear_ce, swiglu.liger_swiglu_down = loss_fn, down_fn
        liger_dspine.revert_liger_kernel_to_deepseek_v3()


def _rank(rank, world_size, path, order, folder):
    return _train_one_step(path, order, folder)


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_v3")
    config = tiny_deepseek_v3_config()
    model = build_model(config)
    model.save_pretrained(path)
    input_ids, labels = _batch(config)
    out = model.train()(input_ids, labels=labels)
    out.loss.backward()
    stepped = {name: (p - p.grad).detach() for name, p in model.named_parameters()}  # SGD, learning rate 1
    return str(path), stepped


@pytest.mark.parametrize("order", ["class", "register"])
def test_default_patch_under_zero3_trainer_matches_one_process(tmp_path, saved_model, order):
    path, stepped = saved_model
    result = run_on_gloo_ranks(tmp_path, 2, _rank, path, order, str(tmp_path), limit_s=900)
    assert {"LigerSwiGLUMLP", "LigerRMSNorm", "LigerGroupedExperts"} <= set(result["liger"])
    assert result["calls"]["loss"] == 1  # the fused loss ran, on the gathered head
    assert result["calls"]["down"] > 0  # the fused SwiGLU down projection ran, on the gathered down_proj
    assert result["params"].keys() == stepped.keys()
    for name, expected in stepped.items():
        torch.testing.assert_close(result["params"][name], expected, **FP32, msg=name)
