"""The default patch under transformers' tensor-parallel plan (``from_pretrained(..., tp_plan="auto")``) on two gloo
ranks, against one unpatched process on the same batch.

Every rank computes the whole batch (tensor parallelism splits the weights, not the data), so each rank's loss and
gathered gradients must equal the single process's. The patch is applied at class level before loading, and as an
instance patch after the plan has sharded the model, in the order a user would write each. fp32; 1e-5 covers the
reordered reductions (the vocabulary-parallel loss, the row-wise all-reduces).
"""

import pytest
import torch

from one_process_reference import assert_matches
from one_process_reference import batch
from one_process_reference import gathered_grads
from one_process_reference import saved_reference
from spawned_ranks import run_on_gloo_ranks

pytest.importorskip("transformers.distributed.tensor_parallel", reason="transformers' DTensor tensor parallelism")
pytestmark = pytest.mark.slow  # spawned gloo ranks loading a model each: a minute or more


def _batch(config):
    return batch(config, 2)


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
        grads = gathered_grads(model)
        kinds = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.startswith("Liger")})
        return {"loss": out.loss.detach(), "logits": out.logits, "grads": grads, "head": sharded, "liger": kinds}
    finally:
        liger_dspine.revert_liger_kernel_to_deepseek_v3()


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    return saved_reference(tmp_path_factory.mktemp("tiny_v3"), rows=2)


@pytest.mark.parametrize("order", ["class", "instance"])
def test_default_patch_under_tensor_parallel_matches_one_process(tmp_path, saved_model, order):
    path, loss, grads = saved_model
    result = run_on_gloo_ranks(tmp_path, 2, _rank, path, order)
    assert result["head"] == "DTensor"  # the plan did shard lm_head over the vocabulary
    assert result["logits"] is None  # the fused (vocabulary-parallel) loss ran
    assert {"LigerSwiGLUMLP", "LigerRMSNorm"} <= set(result["liger"])
    assert_matches(result, loss, grads)
