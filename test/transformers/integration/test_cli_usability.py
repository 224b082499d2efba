"""The command line as a new user meets it: help with every option's default in plain text, ``--version``, arguments
checked before anything loads, the output folder said first, nothing done on a finished ``--resume``, ``convert
--check`` of a train-drafter output folder, and ``--report-to``."""

import argparse
import csv
import importlib.machinery
import sys
import types
from importlib.metadata import version

import pytest
import torch

from liger_dspine.cli import build_parser
from liger_dspine.cli import main
from liger_dspine.drafter_training import setup
from liger_dspine.models.dspine import DSpineDraftModel
from tiny_dspine import tiny_draft_config


def commands(parser):
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {"liger-dspine": parser, **action.choices}


def test_every_option_states_its_default_and_help_is_plain_text():
    parsers = commands(build_parser())
    assert set(parsers) == {
        "liger-dspine",
        "demo",
        "inspect",
        "convert",
        "train-drafter",
        "eval-drafter",
        "generate",
        "capture",
    }
    for name, parser in parsers.items():
        options = [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
        options = [a for a in options if not isinstance(a, argparse._VersionAction)]
        missing = [a.option_strings[0] for a in options if "default: " not in a.help]
        assert missing == [], (name, missing)
        assert "``" not in parser.format_help(), name
    train = {a.dest: a.help for a in parsers["train-drafter"]._actions}
    assert train["seq_len"].endswith("(default: 2048; --tiny: 32)")
    assert train["liger"].endswith("(default: on)")
    assert train["output_dir"].endswith("(default: dspine-drafter)")


def test_version(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out == f"liger-dspine {version('liger-dspine')}\n"


@pytest.fixture
def no_model_loads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was built")

    monkeypatch.setattr(setup, "build_target", refuse)


def test_a_dataset_without_mask_token_is_refused_before_the_target_is_built(tmp_path, capsys, no_model_loads):
    dataset = tmp_path / "data.jsonl"
    dataset.write_text("[1, 2, 3]\n")
    argv = ["train-drafter", "--tiny", "--dataset", str(dataset), "--output-dir", str(tmp_path / "out")]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err == "liger-dspine: a --dataset needs --mask-token-id (a token id never in the data)\n"
    assert captured.out == ""


def test_a_finished_resume_has_nothing_to_do(tmp_path, capsys, no_model_loads):
    (tmp_path / "checkpoint-3").mkdir()
    (tmp_path / "checkpoint-3" / "training_state.pt").write_bytes(b"")
    argv = ["train-drafter", "--tiny", "--steps", "3", "--resume", "--output-dir", str(tmp_path)]
    assert main(argv) == 0
    last = capsys.readouterr().out.splitlines()[-1]  # after any warnings an import printed
    assert last == f"train-drafter: {tmp_path / 'checkpoint-3'} is step 3 of --steps 3: nothing to do (raise --steps)"


def test_the_output_folder_is_said_before_anything_loads(tmp_path, capsys, monkeypatch, no_model_loads):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(AssertionError, match="a model was built"):
        main(["train-drafter", "--tiny"])
    assert f"train-drafter: checkpoints go to {tmp_path / 'dspine-drafter'}" in capsys.readouterr().out.splitlines()


def test_convert_check_of_an_output_folder_checks_its_latest_checkpoint(tmp_path, capsys):
    torch.manual_seed(0)
    draft = DSpineDraftModel(tiny_draft_config())
    for step in (2, 10):
        draft.save_pretrained(tmp_path / f"checkpoint-{step}")
    assert main(["convert", "--check", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    names = f"{tmp_path} is a train-drafter output folder (checkpoint-2, checkpoint-10)"
    assert f"{names}: checking the latest, {tmp_path / 'checkpoint-10'}" in out, out
    assert main(["convert", str(tmp_path), str(tmp_path / "new")]) == 2
    assert capsys.readouterr().err == f"liger-dspine: {names}: convert one of them\n"


def test_report_to_a_missing_package_is_a_clear_error(tmp_path, capsys, monkeypatch, no_model_loads):
    monkeypatch.setitem(sys.modules, "wandb", None)  # found nowhere, as when it is not installed
    argv = ["train-drafter", "--tiny", "--report-to", "wandb", "--output-dir", str(tmp_path)]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        "liger-dspine: --report-to wandb needs the wandb package: pip install 'liger-dspine[wandb]'\n"
    )


def test_report_to_wandb_logs_each_step(tmp_path, monkeypatch):
    logged, finished = [], []
    run = types.SimpleNamespace(
        log=lambda values, step: logged.append((step, values)), finish=lambda: finished.append(1)
    )
    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.init = lambda **kwargs: run
    monkeypatch.setitem(sys.modules, "wandb", fake)
    metrics = tmp_path / "metrics.csv"
    argv = ["train-drafter", "--tiny", "--no-liger", "--steps", "2", "--output-dir", str(tmp_path / "out")]
    assert main([*argv, "--report-to", "wandb", "--metrics-csv", str(metrics)]) == 0
    with open(metrics) as handle:
        losses = [float(row["loss"]) for row in csv.DictReader(handle)]
    assert [step for step, _ in logged] == [1, 2]
    assert [values["train/loss"] for _, values in logged] == pytest.approx(losses, rel=1e-6)
    assert all(values["train/tokens_per_s"] > 0 for _, values in logged)
    assert finished == [1]
