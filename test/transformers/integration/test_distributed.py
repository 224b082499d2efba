"""The patched DeepSeek-V3 under DDP and FSDP2 on two CPU processes (gloo), against one process on the full batch.

Each rank takes half of the batch. Both halves hold the same number of targets (the same ignore pattern per row),
so the mean of the two rank losses, and the mean of their gradients (what DDP and FSDP2 reduce), equal the
full-batch loss and gradients. fp32; 1e-5 covers the reordered reductions.

Two spawns, each running a set of scenarios in one process group (starting two interpreters costs more than the
scenarios themselves): DDP and FSDP2 with the default attention, then FSDP2 with head-grouped attention. Each rank
writes its output to a log of its own (Python tracebacks on a fatal signal included), and a failed spawn names
the scenario each rank was in and the last lines it wrote.
"""

import copy
import faulthandler
import os
import sys
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from liger_dspine import apply_liger_kernel_to_deepseek_v3
from spawned_ranks import join_ranks
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
COLLECTIVE_TIMEOUT = timedelta(seconds=120)  # a rank left waiting on a failed peer fails instead of hanging


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


def _scenario(name: str) -> None:
    print(f"scenario {name}", flush=True)


def _ddp_and_fsdp2(mesh) -> dict:
    report = {}
    _scenario("ddp")
    model, input_ids, labels = patched_model_and_batch()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    report["ddp"] = {**_run(ddp, input_ids, labels), "grads": _full_grads(model)}

    # lm_head in the root's parameter group: the root's pre-forward unshards it before lce_forward reads it
    _scenario("fsdp2")
    model, input_ids, labels = patched_model_and_batch()
    _fsdp2(model, mesh, shard_lm_head=False)
    sharded = _is_sharded(model.lm_head.weight)
    report["fsdp2"] = {**_run(model, input_ids, labels), "grads": _full_grads(model), "head_sharded": sharded}

    # lm_head sharded on its own: the fused loss runs inside lm_head's own FSDP2 hooks, which gather the weight for
    # it and reduce its gradient, without a warning
    _scenario("fsdp2_own_head")
    model, input_ids, labels = patched_model_and_batch()
    _fsdp2(model, mesh, shard_lm_head=True)
    sharded = _is_sharded(model.lm_head.weight)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = _run(model, input_ids, labels)
    report["fsdp2_own_head_warnings"] = [str(w.message) for w in caught if "liger-dspine" in str(w.message)]
    report["fsdp2_own_head"] = {**result, "grads": _full_grads(model), "head_sharded": sharded}
    return report


def _fsdp2_head_groups(mesh) -> dict:
    """Attention run one head at a time (kept per-head graphs, and the recompute) over FSDP2's resharded weights."""
    from liger_dspine.models.deepseek_v3 import head_groups
    from liger_dspine.models.deepseek_v3.attention import LigerDeepseekV3Attention

    head_groups.KEPT_GROUP_BYTES = head_groups.RECOMPUTE_GROUP_BYTES = 1
    grouped_runs = []
    original = LigerDeepseekV3Attention._liger_head_grouped
    LigerDeepseekV3Attention._liger_head_grouped = lambda self, *a: grouped_runs.append(1) or original(self, *a)
    report = {}
    for scenario, options in (("fsdp2_head_groups", {}), ("fsdp2_recompute_head_groups", RECOMPUTE)):
        _scenario(scenario)
        grouped_runs.clear()
        model, input_ids, labels = patched_model_and_batch("sdpa", **options)
        _fsdp2(model, mesh, shard_lm_head=False)
        report[scenario] = {**_run(model, input_ids, labels), "grads": _full_grads(model)}
        report[scenario]["head_grouped_layers"] = len(grouped_runs)
    return report


SCENARIO_SETS = {"ddp_fsdp2": _ddp_and_fsdp2, "fsdp2_head_groups": _fsdp2_head_groups}


def _worker(rank, folder, scenario_set):
    log = open(os.path.join(folder, f"rank{rank}.log"), "w")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    faulthandler.enable(file=log, all_threads=True)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback, whatever the host name resolves to
    store = os.path.join(folder, "store")
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD_SIZE, timeout=COLLECTIVE_TIMEOUT
    )
    try:
        torch.set_num_threads(1)
        from torch.distributed.device_mesh import init_device_mesh

        report = SCENARIO_SETS[scenario_set](init_device_mesh("cpu", (WORLD_SIZE,)))
        _scenario("done")
        dist.barrier()  # both ranks' collectives have finished before either tears down
        if rank == 0:  # a file: tensors sent through a queue would live in this process's shared memory
            torch.save(report, os.path.join(folder, "results.tmp"))
            os.replace(os.path.join(folder, "results.tmp"), os.path.join(folder, "results.pt"))
    finally:
        dist.destroy_process_group()


def _rank_log_summary(folder) -> str:
    """One line: per rank, the scenario it reached, the lines that name an error and the innermost Python frame of
    a fatal signal's traceback."""
    parts = []
    for rank in range(WORLD_SIZE):
        path = os.path.join(folder, f"rank{rank}.log")
        lines = open(path).read().splitlines() if os.path.exists(path) else []
        reached = [line for line in lines if line.startswith("scenario ")][-1:] or ["no scenario started"]
        markers = ("Error", "error", "terminate", "what()", "Fatal")
        notes = [line.strip() for line in lines if any(marker in line for marker in markers)][:4]
        for i, line in enumerate(lines[:-1]):
            if "most recent call first" in line:
                notes.append(lines[i + 1].strip())
                break
        parts.append(f"rank {rank}: {reached[0]}; {' / '.join(notes) or 'no error lines'} (log {path})")
    return " | ".join(parts)


def _spawn(tmp_path_factory, scenario_set: str, limit_s: float = 1200.0, teardown_s: float = 30.0) -> dict:
    """Runs the set on two ranks and returns rank 0's report, written once both ranks passed the final barrier. A
    rank that dies or hangs after that, in the process group's teardown, is reported as a warning or stopped: the
    results are whole."""
    folder = str(tmp_path_factory.mktemp(scenario_set))
    results = os.path.join(folder, "results.pt")
    try:
        context = mp.start_processes(
            _worker, args=(folder, scenario_set), nprocs=WORLD_SIZE, join=False, start_method="spawn"
        )
        finished = lambda: os.path.exists(results)  # noqa: E731
        join_ranks(context, finished, limit_s, teardown_s, f"{scenario_set} on {WORLD_SIZE} gloo ranks")
    except ProcessException as error:
        # a rank's Python exception comes as its traceback: its last line names it
        cause = str(error).strip().splitlines()[-1]
        summary = f"{scenario_set} on {WORLD_SIZE} gloo ranks: {cause} | {_rank_log_summary(folder)}"
        if not os.path.exists(results):
            raise RuntimeError(f"{summary}\n{error}") from None
        warnings.warn(f"after both ranks finished every scenario, in teardown: {summary}", stacklevel=1)
    return torch.load(results)


@pytest.fixture(scope="module")
def ddp_fsdp2_ranks(tmp_path_factory):
    return _spawn(tmp_path_factory, "ddp_fsdp2")


@pytest.fixture(scope="module")
def head_grouped_ranks(tmp_path_factory):
    return _spawn(tmp_path_factory, "fsdp2_head_groups")


@pytest.fixture(scope="module")
def single_process():
    model, input_ids, labels = patched_model_and_batch()
    reference = copy.deepcopy(model)
    out, grads = loss_and_grads(model, input_ids, labels=labels)
    assert out.logits is None
    return out.loss.detach(), grads, reference


def _assert_matches_single_process(result, single_process, logits_skipped=True):
    loss, grads, _ = single_process
    assert result["logits_skipped"] is logits_skipped
    assert result.get("head_sharded", True)  # FSDP2: lm_head.weight is sharded outside the forward
    torch.testing.assert_close(result["loss"], loss, **FP32)
    assert_grads_close(result["grads"], grads, **FP32)


@pytest.mark.parametrize("scenario", ["ddp", "fsdp2", "fsdp2_own_head"])
def test_two_ranks_match_one_process_on_the_full_batch(ddp_fsdp2_ranks, single_process, scenario):
    _assert_matches_single_process(ddp_fsdp2_ranks[scenario], single_process)


@pytest.mark.parametrize("scenario", ["fsdp2_head_groups", "fsdp2_recompute_head_groups"])
def test_head_grouped_attention_on_two_fsdp2_ranks_matches_one_process(head_grouped_ranks, single_process, scenario):
    result = head_grouped_ranks[scenario]
    assert result["head_grouped_layers"] > 0  # the scenario did run attention by head groups
    _assert_matches_single_process(result, single_process)


def test_separately_sharded_lm_head_keeps_the_fused_loss_without_a_warning(ddp_fsdp2_ranks):
    assert ddp_fsdp2_ranks["fsdp2_own_head_warnings"] == []
    assert ddp_fsdp2_ranks["fsdp2_own_head"]["logits_skipped"] is True
