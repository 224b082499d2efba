"""The default patch on 2-D meshes of four gloo ranks, against one unpatched process on the whole batch:
tensor parallel x FSDP2 (``DistributedConfig(tp_size=2, fsdp_size=2)``) and expert parallel x FSDP2
(``DistributedConfig(fsdp_size=4, ep_size=2)``), each at class level and as an instance patch of the sharded model.

The ranks of a tensor-parallel group share a batch; the data-parallel groups take equal slices of it (the same
number of targets each), so the mean of the rank losses and the gathered gradients equal the whole batch's. The
fused loss must run (no logits): vocabulary-parallel inside the head's FSDP2 hooks, or on the gathered head. fp32.
"""

import pytest
import torch

from one_process_reference import assert_matches
from one_process_reference import batch
from one_process_reference import gathered_grads
from one_process_reference import saved_reference
from spawned_ranks import run_on_gloo_ranks

pytest.importorskip("transformers.distributed.fsdp", reason="transformers' distributed plans")
pytestmark = pytest.mark.slow  # spawned gloo ranks loading a model each: a minute or more
BATCH = 4
LAYOUTS = {"tp_x_fsdp": (dict(tp_size=2, fsdp_size=2), 2), "ep_x_fsdp": (dict(fsdp_size=4, ep_size=2), 4)}
SCENARIOS = [(layout, order) for layout in LAYOUTS for order in ("class", "instance")]


def _batch(config):
    return batch(config, BATCH)


def _scenario(path, layout, order, rank, world_size):
    import torch.distributed as dist
    from transformers import DeepseekV3ForCausalLM
    from transformers.distributed import DistributedConfig

    import liger_dspine

    sizes, data_groups = LAYOUTS[layout]
    if order == "class":
        liger_dspine.apply_liger_kernel_to_deepseek_v3()
    try:
        config = DistributedConfig(**sizes)
        model = DeepseekV3ForCausalLM.from_pretrained(path, distributed_config=config, dtype=torch.float32).train()
        if order == "instance":
            liger_dspine.apply_liger_kernel_to_deepseek_v3(model=model)
        input_ids, labels = _batch(model.config)
        group = rank * data_groups // world_size  # ranks of a tensor-parallel group are neighbours
        rows = slice(group * BATCH // data_groups, (group + 1) * BATCH // data_groups)
        out = model(input_ids[rows], labels=labels[rows])
        out.loss.backward()
        loss = out.loss.detach().clone()
        dist.all_reduce(loss)
        grads = gathered_grads(model)
        return {"loss": loss / world_size, "logits": out.logits is not None, "grads": grads}
    finally:
        liger_dspine.revert_liger_kernel_to_deepseek_v3()


def _rank(rank, world_size, path):
    return {scenario: _scenario(path, *scenario, rank, world_size) for scenario in SCENARIOS}


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    return saved_reference(tmp_path_factory.mktemp("tiny_v3"), rows=BATCH)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, saved_model):
    return run_on_gloo_ranks(tmp_path_factory.mktemp("meshes"), 4, _rank, saved_model[0], limit_s=1200)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=["-".join(s) for s in SCENARIOS])
def test_default_patch_on_a_2d_mesh_matches_one_process(ranks, saved_model, scenario):
    _, loss, grads = saved_model
    result = ranks[scenario]
    assert result["logits"] is False  # the fused loss ran
    assert_matches(result, loss, grads)
