"""The patched DeepSeek-V3 under DDP and FSDP2 on two CPU processes (gloo), against one process on the full batch.

Each rank takes half of the batch. Both halves hold the same number of targets (the same ignore pattern per row),
so the mean of the two rank losses, and the mean of their gradients (what DDP and FSDP2 reduce), equal the
full-batch loss and gradients. fp32; 1e-5 covers the reordered reductions.

One spawn runs every scenario (starting two interpreters costs more than the scenarios themselves); the tests
below read its results.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from liger_dspine import apply_liger_kernel_to_deepseek_v3
from tiny_models import assert_grads_close
from tiny_models import build_model
from tiny_models import labels_with_ignored
from tiny_models import loss_and_grads
from tiny_models import random_batch
from tiny_models import tiny_deepseek_v3_config

WORLD_SIZE = 2
RECOMPUTE = {"recompute_attention": True}
BATCH = 4
FP32 = dict(atol=1e-5, rtol=1e-5)


def patched_model_and_batch(attn_implementation="eager", **options):
    config = tiny_deepseek_v3_config(attn_implementation=attn_implementation)
    model = build_model(config)
    apply_liger_kernel_to_deepseek_v3(model=model, **options)
    input_ids, _ = random_batch(config, batch=BATCH, seq=6, seed=5)
    return model.train(), input_ids, labels_with_ignored(input_ids)


def _full_grads(model) -> dict[str, torch.Tensor]:
    """Parameter name -> gradient; FSDP2's sharded DTensor gradients gathered whole."""
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        grads[name] = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
    return grads


def _is_sharded(parameter) -> bool:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Shard

    return isinstance(parameter, DTensor) and parameter.placements == (Shard(0),)


def _mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    value = value.detach().clone()
    dist.all_reduce(value)
    return value / dist.get_world_size()


def _run(model, input_ids, labels, **kwargs):
    rank = dist.get_rank()
    half = slice(rank * BATCH // WORLD_SIZE, (rank + 1) * BATCH // WORLD_SIZE)
    out = model(input_ids[half], labels=labels[half], **kwargs)
    out.loss.backward()
    return {"loss": _mean_over_ranks(out.loss), "logits_skipped": out.logits is None}


def _fsdp2(model, mesh, shard_lm_head: bool):
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    if shard_lm_head:
        fully_shard(model.lm_head, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _worker(rank, store_path, results_path):
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD_SIZE)
    try:
        torch.set_num_threads(1)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (WORLD_SIZE,))
        report = {}

        model, input_ids, labels = patched_model_and_batch()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        report["ddp"] = {**_run(ddp, input_ids, labels), "grads": _full_grads(model)}

        # lm_head in the root's parameter group: the root's pre-forward unshards it before lce_forward reads it
        model, input_ids, labels = patched_model_and_batch()
        _fsdp2(model, mesh, shard_lm_head=False)
        sharded = _is_sharded(model.lm_head.weight)
        report["fsdp2"] = {**_run(model, input_ids, labels), "grads": _full_grads(model), "head_sharded": sharded}

        # lm_head sharded on its own: never gathered for the fused loss, which says so; logits work
        model, input_ids, labels = patched_model_and_batch()
        _fsdp2(model, mesh, shard_lm_head=True)
        sharded = _is_sharded(model.lm_head.weight)
        try:
            _run(model, input_ids, labels)
            report["fsdp2_own_head_error"] = None
        except ValueError as error:
            report["fsdp2_own_head_error"] = str(error)
        model.zero_grad(set_to_none=True)
        report["fsdp2_own_head_logits"] = {
            **_run(model, input_ids, labels, skip_logits=False),
            "grads": _full_grads(model),
            "head_sharded": sharded,
        }
        # attention run one head at a time: kept per-head graphs, and the recompute, over FSDP2's resharded weights
        from liger_dspine.models.deepseek_v3 import head_groups
        from liger_dspine.models.deepseek_v3.attention import LigerDeepseekV3Attention

        head_groups.KEPT_GROUP_BYTES = head_groups.RECOMPUTE_GROUP_BYTES = 1
        grouped_runs = []
        original = LigerDeepseekV3Attention._liger_head_grouped
        LigerDeepseekV3Attention._liger_head_grouped = lambda self, *a: grouped_runs.append(1) or original(self, *a)
        for scenario, options in (("fsdp2_head_groups", {}), ("fsdp2_recompute_head_groups", RECOMPUTE)):
            grouped_runs.clear()
            model, input_ids, labels = patched_model_and_batch("sdpa", **options)
            _fsdp2(model, mesh, shard_lm_head=False)
            report[scenario] = {**_run(model, input_ids, labels), "grads": _full_grads(model)}
            report[scenario]["head_grouped_layers"] = len(grouped_runs)
        if rank == 0:  # a file: tensors sent through a queue would live in this process's shared memory
            torch.save(report, results_path)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gloo")
    results = folder / "results.pt"
    mp.start_processes(
        _worker, args=(str(folder / "store"), str(results)), nprocs=WORLD_SIZE, join=True, start_method="spawn"
    )
    return torch.load(results)


@pytest.fixture(scope="module")
def single_process():
    model, input_ids, labels = patched_model_and_batch()
    reference = copy.deepcopy(model)
    out, grads = loss_and_grads(model, input_ids, labels=labels)
    assert out.logits is None
    return out.loss.detach(), grads, reference


@pytest.mark.parametrize(
    "scenario", ["ddp", "fsdp2", "fsdp2_own_head_logits", "fsdp2_head_groups", "fsdp2_recompute_head_groups"]
)
def test_two_ranks_match_one_process_on_the_full_batch(two_ranks, single_process, scenario):
    loss, grads, _ = single_process
    result = two_ranks[scenario]

    assert result["logits_skipped"] is (scenario != "fsdp2_own_head_logits")
    assert result.get("head_sharded", True)  # FSDP2: lm_head.weight is sharded outside the forward
    assert result.get("head_grouped_layers", 1) > 0  # the head-grouped scenarios did run by head groups
    torch.testing.assert_close(result["loss"], loss, **FP32)
    assert_grads_close(result["grads"], grads, **FP32)


def test_fused_loss_with_a_separately_sharded_lm_head_is_a_clear_error(two_ranks):
    message = two_ranks["fsdp2_own_head_error"]
    assert message is not None
    assert "lm_head.weight is a sharded DTensor" in message and "skip_logits=False" in message
