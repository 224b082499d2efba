"""benchmark/bench_fp8_quantize.py --tiny on the CPU: every layout's row for each implementation, a baseline file
loaded beside the package's quantisers, and a quantiser that differs from the torch reference refused."""

import csv
import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "benchmark"))  # the script's own imports (cuda_timing)
QUANTIZE_SOURCE = os.path.join(ROOT, "src", "liger_dspine", "ops", "fp8_quantize.py")


def load_script():
    path = os.path.join(ROOT, "benchmark", "bench_fp8_quantize.py")
    spec = importlib.util.spec_from_file_location("bench_fp8_quantize", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_run_with_a_baseline_writes_every_row(tmp_path):
    assert load_script().main(["--tiny", "--out", str(tmp_path), "--baseline", QUANTIZE_SOURCE]) == 0
    with open(tmp_path / "fp8_quantize_tiny.csv") as handle:
        rows = list(csv.DictReader(handle))
    impls = ("triton", "torch", "copy", "baseline")
    expected = [(layout, impl) for layout in ("rows", "columns", "group columns") for impl in impls]
    # the expert weights' rows pass with their column amax, and the column pass given it: no baseline row (the
    # baseline file is any version of the quantisers, which may lack them)
    expected += [(layout, impl) for layout in ("rows + column amax", "columns, amax given") for impl in impls[:3]]
    assert [(r["layout"], r["impl"]) for r in rows] == expected
    table = (tmp_path / "fp8_quantize_tiny.md").read_text()
    assert "baseline ms" in table and table.count("| tiny |") == 5
    assert "| tiny | rows + column amax |" in table and "| all with a baseline row |" in table


def test_a_quantiser_that_differs_from_the_reference_is_refused(tmp_path, monkeypatch):
    script = load_script()
    rows_op, reference, extra = script.OPS["rows"]

    def doubled_scale(x):
        q, scale = rows_op(x)
        return q, scale * 2

    monkeypatch.setitem(script.OPS, "rows", (doubled_scale, reference, extra))
    with pytest.raises(AssertionError, match="rows: the triton quantiser's output differs"):
        script.main(["--tiny", "--out", str(tmp_path)])
