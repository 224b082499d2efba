"""The default patch under transformers' tensor-parallel plan (``from_pretrained(..., tp_plan="auto")``) on two gloo
ranks, against one unpatched process on the same batch.

Every rank computes the whole batch (tensor parallelism splits the weights, not the data), so each rank's loss and
gathered gradients must equal the single process's. The patch is applied at class level before loading, and as an
instance patch after the plan has sharded the model, in the order a user would write each. fp32; 1e-5 covers the
reordered reductions (the vocabulary-parallel loss, the row-wise all-reduces).
"""

import pytest
import torch

from spawned_ranks import run_on_gloo_ranks
from tiny_models import build_model
from tiny_models import labels_with_ignored
from tiny_models import random_batch
from tiny_models import tiny_deepseek_v3_config

pytest.importorskip("transformers.distributed.tensor_parallel", reason="transformers' DTensor tensor parallelism")
FP32 = dict(atol=1e-5, rtol=1e-5)
pytestmark = pytest.mark.slow  # spawned gloo ranks loading a model each: a minute or more


def _batch(config):
    input_ids, _ = random_batch(config, batch=2, seq=6, seed=5)
    return input_ids, labels_with_ignored(input_ids)


def _rank(rank, world_size, path, order):
    from transformers import DeepseekV3ForCausalLM

    import liger_dspine

    if order == "class":
        liger_dspine.apply_liger_kernel_to_deepseek_v3()
    try:
        model = DeepseekV3ForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32).train()
        if order == "instance":
            liger_dspine.apply_liger_kernel_to_deepseek_v3(model=model)
        sharded = type(model.lm_head.weight).__name__
        input_ids, labels = _batch(model.config)
        out = model(input_ids, labels=labels)
        out.loss.backward()
        grads = {}
        for name, p in model.named_parameters():
            grads[name] = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        kinds = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.startswith("Liger")})
        return {"loss": out.loss.detach(), "logits": out.logits, "grads": grads, "head": sharded, "liger": kinds}
    finally:
        liger_dspine.revert_liger_kernel_to_deepseek_v3()


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_v3")
    config = tiny_deepseek_v3_config()
    model = build_model(config)
    model.save_pretrained(path)
    input_ids, labels = _batch(config)
    out = model.train()(input_ids, labels=labels)
    out.loss.backward()
    return str(path), out.loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("order", ["class", "instance"])
def test_default_patch_under_tensor_parallel_matches_one_process(tmp_path, saved_model, order):
    path, loss, grads = saved_model
    result = run_on_gloo_ranks(tmp_path, 2, _rank, path, order)
    assert result["head"] == "DTensor"  # the plan did shard lm_head over the vocabulary
    assert result["logits"] is None  # the fused (vocabulary-parallel) loss ran
    assert {"LigerSwiGLUMLP", "LigerRMSNorm"} <= set(result["liger"])
    torch.testing.assert_close(result["loss"], loss, **FP32)
    assert result["grads"].keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(result["grads"][name], grad, **FP32, msg=name)
