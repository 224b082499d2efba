"""The default patch under FSDP2 on two gloo ranks, against one unpatched process on the whole batch.

- transformers' own plan (``DistributedConfig(fsdp_size=2)``): it shards the final norm and ``lm_head`` as one group,
  which the norm's forward gathers, so the fused loss runs on the gathered head (no logits); at class level and as an
  instance patch of the sharded model;
- ``fully_shard`` applied by hand to every MLP and decoder layer, then the instance patch: the converted modules keep
  their FSDP2 class (``FSDPLigerSwiGLUMLP``), and the revert gives back ``FSDPDeepseekV3MLP``.

Each rank takes half of the batch with the same number of targets, so the mean of the rank losses and the mean of
their gradients (what FSDP2 reduces) equal the whole batch's. fp32; 1e-5 covers the reordered reductions.
"""

import pytest
import torch

from one_process_reference import assert_matches
from one_process_reference import fully_shard_layers
from one_process_reference import rank_step
from one_process_reference import saved_reference
from spawned_ranks import run_on_gloo_ranks

pytest.importorskip("transformers.distributed.fsdp", reason="transformers' FSDP2 plan")
pytestmark = pytest.mark.slow  # spawned gloo ranks loading a model each: a minute or more
BATCH = 4


def _plan(path, order, rank, world_size):
    from transformers import DeepseekV3ForCausalLM
    from transformers.distributed import DistributedConfig

    import liger_dspine

    if order == "class":
        liger_dspine.apply_liger_kernel_to_deepseek_v3()
    try:
        layout = DistributedConfig(fsdp_size=world_size)
        model = DeepseekV3ForCausalLM.from_pretrained(path, distributed_config=layout, dtype=torch.float32).train()
        if order == "instance":
            liger_dspine.apply_liger_kernel_to_deepseek_v3(model=model)
        return rank_step(model, rank, world_size, BATCH)
    finally:
        liger_dspine.revert_liger_kernel_to_deepseek_v3()


def _by_hand(path, rank, world_size):
    from torch.distributed.fsdp import FSDPModule
    from transformers import DeepseekV3ForCausalLM

    import liger_dspine

    model = DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    fully_shard_layers(model, world_size)
    liger_dspine.apply_liger_kernel_to_deepseek_v3(model=model)
    mlp = model.model.layers[0].mlp
    result = rank_step(model, rank, world_size, BATCH)
    result["mlp_class"] = (type(mlp).__name__, isinstance(mlp, FSDPModule))
    liger_dspine.revert_liger_kernel_to_deepseek_v3(model=model)
    result["reverted_mlp_class"] = (type(mlp).__name__, isinstance(mlp, FSDPModule))
    return result


def _rank(rank, world_size, path):
    results = {order: _plan(path, order, rank, world_size) for order in ("class", "instance")}
    results["by_hand"] = _by_hand(path, rank, world_size)
    return results


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    return saved_reference(tmp_path_factory.mktemp("tiny_v3"), rows=BATCH)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, saved_model):
    return run_on_gloo_ranks(tmp_path_factory.mktemp("fsdp2"), 2, _rank, saved_model[0])


@pytest.mark.parametrize("scenario", ["class", "instance", "by_hand"])
def test_default_patch_under_fsdp2_matches_one_process(ranks, saved_model, scenario):
    _, loss, grads = saved_model
    result = ranks[scenario]
    assert result["logits"] is False  # the fused loss ran on the gathered head
    assert_matches(result, loss, grads)


def test_instance_patch_keeps_the_fsdp2_class(ranks):
    assert ranks["by_hand"]["mlp_class"] == ("FSDPLigerSwiGLUMLP", True)
    assert ranks["by_hand"]["reverted_mlp_class"] == ("FSDPDeepseekV3MLP", True)
