"""``benchmark/bench_capture.py --tiny``: the capture benchmark's plumbing on CPU. Its times are not speeds here;
every method must return the same taps and final states, bit for bit."""

import csv
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "benchmark" / "bench_capture.py"


@pytest.mark.slow  # a benchmark run: make test-slow
def test_capture_benchmark_tiny(tmp_path):
    command = [sys.executable, str(SCRIPT), "--tiny", "--seq", "16", "--out-dir", str(tmp_path), "--name", "tiny"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(tmp_path / "tiny.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert {(r["impl"], r["method"]) for r in rows} == {
        (impl, method)
        for impl in ("native", "liger-dspine")
        for method in ("capture", "hidden_states", "causal_lm_hidden_states")
    }
    assert all(float(r["max_abs_diff"]) == 0.0 for r in rows)
    # taps [0, 1] and the final states of a 16-token row at hidden 32, fp32
    assert all(float(r["returned_gib"]) == 3 * 16 * 32 * 4 / 2**30 for r in rows)
    assert "speed vs hidden_states" in (tmp_path / "tiny.md").read_text()
