"""``liger-dspine train-drafter``: a tiny run end to end, exact resume, DDP over two gloo ranks, argument errors.

All fp32 on the CPU with ``--no-liger`` (the drafter's Liger modules and the fused objective have their own tests;
here they would run through Triton's interpreter).
"""

import argparse
import csv
import os
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from liger_dspine.cli import main
from liger_dspine.drafter_training.loop import ddp_sync_context
from liger_dspine.drafter_training.loop import drafter_step
from liger_dspine.drafter_training.loop import train_drafter
from liger_dspine.drafter_training.options import add_arguments
from liger_dspine.drafter_training.options import resolve
from liger_dspine.models.dspine import DSpineAccumulationWindow
from liger_dspine.models.dspine import DSpineDraftModel
from liger_dspine.models.dspine import DSpineObjective
from liger_dspine.models.dspine.capture import TargetCapture
from liger_dspine.models.dspine.checkpoint import check_checkpoint
from spawned_ranks import join_ranks
from tiny_dspine import TINY_MASK_TOKEN
from tiny_dspine import TINY_TAPS
from tiny_dspine import tiny_draft_config
from tiny_dspine import tiny_target

SEQ = 12
ROWS = 4  # per micro-batch, over all ranks
WORLD_SIZE = 2


def parse(*argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return resolve(parser.parse_args(["--tiny", "--no-liger", *argv]))


def read_losses(path) -> list[float]:
    with open(path) as handle:
        return [float(row["loss"]) for row in csv.DictReader(handle)]


@pytest.mark.slow  # 30 train-drafter steps: make test-slow
def test_tiny_run_writes_a_specforge_checkpoint_and_the_loss_falls(tmp_path):
    metrics = tmp_path / "metrics.csv"
    argv = ["train-drafter", "--tiny", "--no-liger", "--steps", "30", "--output-dir", str(tmp_path / "out")]
    assert main([*argv, "--metrics-csv", str(metrics)]) == 0
    losses = read_losses(metrics)
    assert len(losses) == 30
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.95 * first, (first, last)
    report = check_checkpoint(tmp_path / "out" / "checkpoint-30")
    assert report.ok, report


@pytest.mark.parametrize("rank", ["0", "1"])
def test_only_rank_0_prints_the_final_line(tmp_path, capsys, monkeypatch, rank):
    monkeypatch.setenv("RANK", rank)  # WORLD_SIZE unset: one process, as a torchrun rank would report
    assert main(["train-drafter", "--tiny", "--no-liger", "--steps", "1", "--output-dir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert ("step 1: loss" in printed) == (rank == "0"), printed


@pytest.mark.slow  # three train-drafter runs: make test-slow
def test_resume_from_a_mid_run_checkpoint_continues_the_same_loss_curve(tmp_path):
    """Bit-equal: the resumed run restores weights (fp32 safetensors), AdamW and scheduler state, the RNG (anchor and
    teacher-forcing draws) and the data position, and runs the same fp32 CPU kernels in the same order."""
    common = ["--steps", "6", "--save-every", "3", "--accumulation-steps", "2", "--warmup-steps", "2"]
    straight = train_drafter(parse(*common, "--output-dir", str(tmp_path / "straight")))
    interrupted = parse(*common, "--output-dir", str(tmp_path / "resumed"))
    before = train_drafter(interrupted, stop_after=4)  # step 4 is lost: the run resumes from checkpoint-3
    after = train_drafter(parse(*common, "--output-dir", str(tmp_path / "resumed"), "--resume"))

    assert [m["step"] for m in after] == [4, 5, 6]
    assert [m["loss"] for m in before] == [m["loss"] for m in straight[:4]]
    assert [m["loss"] for m in after] == [m["loss"] for m in straight[3:]]
    assert [m["lr"] for m in after] == [m["lr"] for m in straight[3:]]
    from safetensors.torch import load_file

    final = [load_file(tmp_path / name / "checkpoint-6" / "model.safetensors") for name in ("straight", "resumed")]
    assert final[0].keys() == final[1].keys()
    assert all(torch.equal(final[0][key], final[1][key]) for key in final[0])


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "needs a target"),
        (["--target-config", "tiny", "--target", "."], "not both"),
        (["--target-config", "missing.json"], "neither 'tiny' nor a config file"),
        (["--tiny", "--steps", "0"], "--steps must be >= 1"),
        (["--tiny", "--warmup-steps", "50", "--steps", "10"], "exceeds --steps"),
        (["--tiny", "--block-size", "1"], "--block-size must be >= 2"),
        (["--tiny", "--target-layer-ids", "0,x"], "comma-separated integers"),
        (["--tiny", "--target-layer-ids", "0,7"], "must lie in [0, 2)"),
        (["--target-config", "tiny"], "default taps of a 2-layer drafter, [1, -1], do not fit a 2-layer target"),
        (
            ["--tiny", "--transfer-rank", "100"],
            "transfer_rank must be in (0, min(hidden_size, vocab_size - 1)] = (0, 64], got 100",
        ),
        (["--tiny", "--top-k", "300"], "top_k must be in [1, vocab_size=256], got 300"),
        (["--tiny", "--drafter-config", __file__, "--top-k", "4"], "fixes the drafter's sizes: leave out --top-k"),
        (["--tiny", "--drafter-config", __file__, "--drafter-layers", "3"], "leave out --drafter-layers"),
    ],
)
def test_bad_arguments_are_clear_errors(tmp_path, capsys, argv, message):
    assert main(["train-drafter", "--no-liger", "--output-dir", str(tmp_path), *argv]) == 2
    error = capsys.readouterr().err
    assert error.startswith("liger-dspine:") and message in error, error


def test_default_sizes_are_fitted_to_a_small_target_and_given_sizes_are_kept():
    from liger_dspine.drafter_training.setup import drafter_config

    target = SimpleNamespace(config=SimpleNamespace(hidden_size=64, vocab_size=256, num_hidden_layers=2))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    # Full-size defaults: transfer rank 1024, top-k 16.
    full_size = resolve(parser.parse_args(["--target-config", "tiny", "--target-layer-ids", "0,1"]))
    default = drafter_config(full_size, target).dspine_options
    assert (default.transfer_rank, default.top_k) == (64, 16)
    given = drafter_config(parse("--transfer-rank", "32", "--top-k", "256"), target).dspine_options
    assert (given.transfer_rank, given.top_k) == (32, 256)


def test_a_dataset_line_without_token_ids_is_a_clear_error(tmp_path, capsys):
    dataset = tmp_path / "data.jsonl"
    dataset.write_text('{"input_ids": [1, 2, 3]}\n{"text": "no ids"}\n')
    argv = ["train-drafter", "--tiny", "--no-liger", "--dataset", str(dataset), "--mask-token-id", "0"]
    assert main([*argv, "--output-dir", str(tmp_path)]) == 2
    assert f"liger-dspine: {dataset}:2 needs a list of token ids" in capsys.readouterr().err


def test_a_dataset_token_outside_the_vocabulary_is_named_before_training(tmp_path, capsys):
    dataset = tmp_path / "data.jsonl"
    dataset.write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [4, 5000, 6]}\n')
    argv = ["train-drafter", "--tiny", "--no-liger", "--dataset", str(dataset), "--mask-token-id", "0"]
    assert main([*argv, "--output-dir", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert f"liger-dspine: {dataset}:2 has token id 5000 in input_ids (index 1), outside the target's vocab" in error
    assert not (tmp_path / "out" / "checkpoint-1").exists()


def test_resuming_with_another_drafter_configuration_is_refused(tmp_path, capsys):
    common = ["train-drafter", "--tiny", "--no-liger", "--steps", "1", "--output-dir", str(tmp_path)]
    assert main(common) == 0
    assert main([*common, "--steps", "2", "--resume", "--block-size", "8"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after the first run's progress bars
    assert last.startswith("liger-dspine:") and "(block_size: saved 4, now 8)" in last, last


def test_a_drafter_config_error_is_one_line(tmp_path, capsys):
    argv = ["train-drafter", "--tiny", "--no-liger", "--output-dir", str(tmp_path), "--transfer-rank", "0"]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert error.startswith("liger-dspine: DSpine") and error.count("\n") == 1, error


# ------------------------------------------------------------------------------------------------------ DDP, 2 ranks
def _objective(target):
    """Every position an anchor (N >= S) with full loss masks and no teacher forcing (no horizon): the draws do not
    depend on the RNG, so any split of the rows over ranks and micro-batches sees the same blocks."""
    torch.manual_seed(11)
    draft = DSpineDraftModel(tiny_draft_config())
    with torch.no_grad():
        for write in draft.injection.writes:
            write.weight.normal_(0.0, 0.05)
    return DSpineObjective(draft, target.lm_head, target.model.embed_tokens, num_anchors=SEQ).train()


def _micro_batches(rows: slice) -> list[dict]:
    generator = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(2):
        input_ids = torch.randint(0, TINY_MASK_TOKEN, (ROWS, SEQ), generator=generator)
        batches.append({"input_ids": input_ids[rows], "loss_mask": torch.ones(ROWS, SEQ)[rows]})
    return batches


def _step(target, objective, ddp=None, rows=slice(None)):
    target_capture = TargetCapture(target, TINY_TAPS)
    window = DSpineAccumulationWindow(ddp or objective, accumulation_steps=2)
    metrics = drafter_step(window, target_capture, _micro_batches(rows), 100, None, ddp_sync_context(ddp))
    grads = {name: p.grad.clone() for name, p in objective.draft_model.named_parameters() if p.grad is not None}
    return metrics, grads


def _ddp_worker(rank, folder):
    dist.init_process_group(
        "gloo", init_method=f"file://{folder}/store", rank=rank, world_size=WORLD_SIZE, timeout=timedelta(seconds=120)
    )
    try:
        torch.set_num_threads(1)
        target = tiny_target()
        objective = _objective(target)
        ddp = torch.nn.parallel.DistributedDataParallel(objective, broadcast_buffers=False)
        reductions = []

        def counting_allreduce(state, bucket):
            reductions.append(len(bucket.gradients()))
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            return allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, counting_allreduce)
        half = slice(rank * ROWS // WORLD_SIZE, (rank + 1) * ROWS // WORLD_SIZE)
        _, grads = _step(target, objective, ddp, half)
        if rank == 0:
            torch.save({"grads": grads, "reductions": reductions}, os.path.join(folder, "rank0.pt"))
        dist.barrier()
        open(os.path.join(folder, f"done{rank}"), "w").close()  # past the last collective: the results are whole
    finally:
        dist.destroy_process_group()


def _run_ranks(folder, limit_s=300.0, teardown_s=30.0):
    """Both ranks of _ddp_worker, each writing ``done<rank>`` once past its last collective."""
    context = mp.start_processes(_ddp_worker, args=(folder,), nprocs=WORLD_SIZE, join=False, start_method="spawn")
    finished = lambda: all(os.path.exists(os.path.join(folder, f"done{r}")) for r in range(WORLD_SIZE))  # noqa: E731
    join_ranks(context, finished, limit_s, teardown_s, f"the {WORLD_SIZE} DDP ranks")


@pytest.mark.slow  # spawned gloo ranks: make test-slow
def test_ddp_step_on_two_gloo_ranks_matches_one_process_on_the_whole_batch(tmp_path):
    """fp32: DDP averages the ranks' gradients of numerator * world / D_global, which is the single process's
    gradient of sum(numerators) / D; only the summation order differs (tolerance of the accumulation tests)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    _run_ranks(str(tmp_path))
    ranks = torch.load(tmp_path / "rank0.pt")

    target = tiny_target()
    _, reference = _step(target, _objective(target))
    assert ranks["reductions"] and sum(ranks["reductions"]) == len(reference)  # each gradient reduced once
    assert ranks["grads"].keys() == reference.keys()
    for name, grad in reference.items():
        torch.testing.assert_close(ranks["grads"][name], grad, atol=2e-5, rtol=2e-4, msg=name)
