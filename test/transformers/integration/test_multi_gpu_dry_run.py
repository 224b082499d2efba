"""benchmark/run_multi_gpu.sh --dry-run on CPU (gloo, a tiny model, 2 steps): the tensor-parallel run on two ranks
and the expert-parallel x FSDP2 run on four, native and patched, give the same loss curves and the report's table."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[3]


def test_dry_run_of_two_engines(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)}
    result = subprocess.run(
        ["bash", str(ROOT / "benchmark" / "run_multi_gpu.sh"), "--dry-run", "tp", "ep_fsdp"],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with open(tmp_path / "multi_gpu.csv") as f:
        rows = {row["engine"]: row for row in csv.DictReader(f)}
    assert sorted(rows) == ["ep_fsdp", "tp"]
    assert [rows[engine]["ranks"] for engine in ("tp", "ep_fsdp")] == ["2", "4"]
    for row in rows.values():  # two steps of AdamW on the same batches: the same losses within fp32 rounding
        assert float(row["final_loss_rel_diff"]) < 1e-5
