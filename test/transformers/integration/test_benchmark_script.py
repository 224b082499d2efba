"""``benchmark/bench_deepseek_v3.py --tiny``: the GPU benchmark's plumbing on CPU (one process per configuration,
CSV and markdown report), so that a broken script is found before a GPU run. Its numbers are not speeds here; the
three implementations' losses on the same model and batch must agree."""

import csv
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the DeepSeek-V3 benchmark through the interpreter: minutes: make test-slow

SCRIPT = Path(__file__).resolve().parents[3] / "benchmark" / "bench_deepseek_v3.py"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    command = [sys.executable, str(SCRIPT), "--suite", "custom", "--shapes", "2x4096", "--tiny", "--no-plots"]
    command += ["--warmup", "1", "--steps", "1", "--out-dir", str(out), "--name", "plumbing"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(out / "tiny_plumbing.csv") as f:
        rows = list(csv.DictReader(f))
    return rows, (out / "tiny_plumbing.md").read_text()


def test_every_implementation_measured(tiny_run):
    rows, _ = tiny_run
    steps = {row["impl"]: row for row in rows if row["kind"] == "throughput"}
    assert sorted(steps) == ["hf", "liger", "liger-dspine"]
    for impl, row in steps.items():
        assert row["status"] == "ok", impl
        assert (row["layers"], row["seq"]) == ("2", "16"), impl  # --tiny maps 4096 tokens onto 16
        assert float(row["tokens_per_s"]) > 0 and float(row["first_step_s"]) > 0, impl
    assert [row["kind"] for row in rows].count("matmul") == 1  # the MFU denominator, measured in the same run


def test_the_three_losses_agree(tiny_run):
    rows, _ = tiny_run
    losses = {row["impl"]: float(row["loss"]) for row in rows if row["kind"] == "throughput"}
    assert max(losses.values()) - min(losses.values()) < 1e-4, losses


def test_report_has_the_ratio_columns(tiny_run):
    _, report = tiny_run
    assert "liger-dspine/hf speed" in report and "liger-dspine/liger peak" in report
    assert "| 2 | 16 |" in report
