"""benchmark/bench_drafter_acceptance.py --tiny on the CPU: both paths train from the same weights on the same batches
(the same losses, the same acceptance lengths), the untrained row comes first, and the CSV and table are written."""

import csv
import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "benchmark" / "bench_drafter_acceptance.py"


def test_tiny_run_trains_both_paths_alike_and_writes_its_table(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_drafter_acceptance", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)

    result = module.main(["--tiny", "--out", str(tmp_path)])
    rows = result["rows"]
    assert [(row["impl"], row["step"]) for row in rows] == [("untrained", 0), ("native", 2), ("liger", 2)]
    native, liger = rows[1], rows[2]
    assert liger["loss"] == pytest.approx(native["loss"], rel=1e-5)  # fp32, dspine.md section 7.4's 2e-5
    for row in rows:
        for variant in ("refined", "plain"):
            assert 1.0 <= row[variant] <= 4.0  # an acceptance length of a block of 4
    assert liger["refined"] == pytest.approx(native["refined"], abs=0.05)
    assert result["checks"]["refined agrees"] and result["checks"]["plain agrees"]
    with open(tmp_path / "drafter_acceptance_tiny.csv", newline="") as handle:
        written = list(csv.DictReader(handle))
    assert [row["impl"] for row in written] == ["untrained", "native", "liger"]
    table = (tmp_path / "drafter_acceptance_tiny.md").read_text()
    assert "| liger | 2 |" in table and "| refined |" in table and "= generate" in table
