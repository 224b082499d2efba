"""``train-drafter`` with the drafter under FSDP2 and the frozen target sharded (FSDP2, tensor parallelism) on two
gloo ranks, against one process on the same global batch.

One spawn runs every sharded case in turn; each test compares one of them. The one-process run takes both ranks' rows
per micro-batch. The drafter config turns teacher forcing off and the anchor budget covers every position, so the
random draws (one per rank, over its own rows) pick the same blocks as the single process's; fp32, what remains is
the summation order (1e-5).
"""

import argparse
import os
import shutil

import pytest
import torch

from spawned_ranks import run_on_gloo_ranks

pytestmark = pytest.mark.slow  # spawned gloo ranks, five short train-drafter runs: about a minute

STEPS = 2
COMMON = ("--no-liger", "--seq-len", "16", "--num-anchors", "16", "--lr", "3e-3", "--dtype", "float32")
# a clipping bound never reached: the clip runs (on DTensor gradients under FSDP2) without hiding a gradient's scale,
# which AdamW's first moment then shows
COMMON += ("--steps", str(STEPS), "--accumulation-steps", "2", "--max-grad-norm", "1e6")


def _parse(output_dir, target, config, batch_size, *extra):
    from liger_dspine.drafter_training.options import add_arguments
    from liger_dspine.drafter_training.options import resolve

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    source = ["--target", target] if os.path.isdir(target) else ["--target-config", target]
    argv = [*source, "--drafter-config", config, "--batch-size", str(batch_size), "--output-dir", str(output_dir)]
    return resolve(parser.parse_args([*argv, *COMMON, *extra]))


def _losses(history) -> list[float]:
    return [metrics["loss"] for metrics in history]


def _sharded_runs(rank, world_size, folder, target, config):
    import torch.distributed as dist

    from liger_dspine.drafter_training import parallel
    from liger_dspine.drafter_training.loop import train_drafter
    from liger_dspine.modules.parallel_state import is_dtensor

    wrap, sharding = parallel.wrap_drafter, []

    def recording(objective, *args):  # what each run sharded: the drafter's weights, the target's head
        wrapped = wrap(objective, *args)
        drafter = is_dtensor(objective.draft_model.fc.weight)
        sharding.append((drafter, isinstance(objective.lm_head, parallel.WholeWeight)))
        return wrapped

    parallel.wrap_drafter = recording

    def run(name, *extra, source="tiny", stop_after=None):
        args = _parse(os.path.join(folder, name), source, config, 1, *extra)
        return _losses(train_drafter(args, stop_after=stop_after))

    results = {"drafter_fsdp": run("drafter_fsdp", "--drafter-parallel", "fsdp", "--save-every", "1")}
    if rank == 0:  # an interrupted run: only its first checkpoint was written
        shutil.copytree(
            os.path.join(folder, "drafter_fsdp", "checkpoint-1"), os.path.join(folder, "resumed", "checkpoint-1")
        )
    dist.barrier()
    results["resumed"] = run("resumed", "--drafter-parallel", "fsdp", "--resume")
    results["target_fsdp"] = run("target_fsdp", "--target-parallel", "fsdp")
    results["target_tp"] = run("target_tp", "--target-parallel", "tp", "--drafter-parallel", "fsdp", source=target)
    results["sharding"] = dict(zip(("drafter_fsdp", "resumed", "target_fsdp", "target_tp"), sharding))
    return results


def _weights(folder):
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, f"checkpoint-{STEPS}", "model.safetensors"))


def _optimizer(folder):
    path = os.path.join(folder, f"checkpoint-{STEPS}", "training_state.pt")
    return torch.load(path, weights_only=False)["optimizer"]


def _assert_same_checkpoint(folder, reference, atol=1e-5):
    weights, expected = _weights(folder), _weights(reference)
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(weights[name], tensor, atol=atol, rtol=1e-5, msg=name)
    state, expected = _optimizer(folder), _optimizer(reference)
    assert [{**g, "betas": tuple(g["betas"])} for g in state["param_groups"]] == expected["param_groups"]
    assert state["state"].keys() == expected["state"].keys()
    for index, moments in expected["state"].items():
        for key, value in moments.items():
            torch.testing.assert_close(state["state"][index][key], value, atol=1e-5, rtol=1e-4, msg=f"{index}.{key}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(rank 0's losses of every sharded run, their folder, the one-process losses, its folder)."""
    from types import SimpleNamespace

    from liger_dspine.demo import demo_config
    from liger_dspine.drafter_training import setup
    from liger_dspine.drafter_training.loop import train_drafter
    from liger_dspine.drafter_training.options import add_arguments
    from liger_dspine.drafter_training.options import resolve

    folder = tmp_path_factory.mktemp("sharded_train_drafter")
    config_path, target_path = str(folder / "drafter.json"), str(folder / "target")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = resolve(parser.parse_args(["--tiny", "--no-liger"]))  # the tiny drafter's sizes
    config = setup.drafter_config(args, SimpleNamespace(config=demo_config()))
    config.dspine_config = {**config.dspine_config, "replacement_probability": 0.0}  # no teacher-forcing draws
    config.to_json_file(config_path)
    setup.build_target(args, torch.device("cpu"), torch.float32).save_pretrained(target_path)
    reference = train_drafter(_parse(folder / "one_process", "tiny", config_path, 2))
    (folder / "ranks").mkdir()
    sharded = run_on_gloo_ranks(folder / "ranks", 2, _sharded_runs, str(folder / "ranks"), target_path, config_path)
    return sharded, folder / "ranks", _losses(reference), folder / "one_process"


def test_drafter_under_fsdp2_matches_one_process(runs):
    sharded, folder, losses, reference = runs
    assert sharded["sharding"]["drafter_fsdp"] == (True, False)
    assert sharded["drafter_fsdp"] == pytest.approx(losses, rel=1e-5)
    _assert_same_checkpoint(folder / "drafter_fsdp", reference)


def test_resume_under_fsdp2_continues_the_uninterrupted_run(runs):
    sharded, folder, _, _ = runs
    assert sharded["sharding"]["resumed"] == (True, False)
    assert sharded["resumed"] == pytest.approx(sharded["drafter_fsdp"][1:], rel=1e-6)
    _assert_same_checkpoint(folder / "resumed", folder / "drafter_fsdp")


def test_target_under_fsdp2_matches_one_process(runs):
    sharded, folder, losses, reference = runs
    assert sharded["sharding"]["target_fsdp"] == (False, True)  # DDP of the drafter, the head read whole
    assert sharded["target_fsdp"] == pytest.approx(losses, rel=1e-5)
    _assert_same_checkpoint(folder / "target_fsdp", reference)


def test_tensor_parallel_target_with_fsdp2_drafter_matches_one_process(runs):
    sharded, folder, losses, reference = runs
    assert sharded["sharding"]["target_tp"] == (True, True)
    assert sharded["target_tp"] == pytest.approx(losses, rel=1e-5)
    # the plan's all-reduces reorder the taps' sums (about 1e-7); AdamW's first steps scale each gradient element
    # to about +-lr, so an element whose gradient is near 0 moves by up to a few 1e-5
    _assert_same_checkpoint(folder / "target_tp", reference, atol=5e-5)


@pytest.mark.parametrize(
    "argv, world_size, message",
    [
        (["--drafter-parallel", "fsdp"], None, "--drafter-parallel fsdp shards over torchrun's processes"),
        (["--target-parallel", "fsdp"], "1", "--target-parallel fsdp shards over torchrun's processes"),
        (["--target-parallel", "tp"], "2", "--target-parallel tp loads a --target folder"),
        (["--drafter-parallel", "fsdp", "--eval-dataset", __file__], "2", "--eval-dataset evaluates on rank 0 alone"),
    ],
)
def test_a_combination_that_cannot_run_is_one_line_before_loading(capsys, monkeypatch, argv, world_size, message):
    from liger_dspine.cli import main

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)  # not launched by torchrun
    if world_size is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world_size)
    assert main(["train-drafter", "--tiny", "--no-liger", *argv]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith(f"liger-dspine: {message}") and "\n" not in error, error


def test_one_torchrun_process_shards_over_itself_and_equals_a_plain_run(tmp_path):
    """torchrun with one process: FSDP2 drafter and FSDP2 target over a one-rank group give the plain run's weights."""
    import subprocess
    import sys

    command = ["-m", "liger_dspine.cli", "train-drafter", "--tiny", "--no-liger", "--steps", str(STEPS)]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    sharding = ["--drafter-parallel", "fsdp", "--target-parallel", "fsdp"]
    runs = {"plain": [sys.executable, *command], "sharded": [*launch, *command, *sharding]}
    for name, argv in runs.items():
        done = subprocess.run([*argv, "--output-dir", str(tmp_path / name)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
    weights, expected = _weights(tmp_path / "sharded"), _weights(tmp_path / "plain")
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(weights[name], tensor, atol=1e-6, rtol=1e-6, msg=name)
