"""benchmark/bench_fp8_gemm.py --tiny on the CPU: the FP8 paths' error against the fp64 product stays within what
e4m3's rounding allows, and bf16's within bf16's."""

import csv
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "benchmark"))  # the script's own imports (cuda_timing)


def test_tiny_run_writes_rows_with_errors_within_the_formats(tmp_path):
    path = os.path.join(ROOT, "benchmark", "bench_fp8_gemm.py")
    spec = importlib.util.spec_from_file_location("bench_fp8_gemm", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--tiny", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "fp8_gemm_tiny.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["gemm"], r["impl"]) for r in rows] == [
        ("linear", "bf16"), ("linear", "fp8"), ("linear", "weight quant"),
        ("experts", "bf16"), ("experts", "fp8"), ("experts", "weight quant"),
    ]  # fmt: skip
    for row in rows:
        if row["impl"] == "weight quant":  # a time only (none on a CPU)
            continue
        error = float(row["rel_error"])
        # each operand element rounds by at most 2^-4 relative in e4m3 (3 mantissa bits), 2^-8 in bf16, and the
        # output once more in bf16: a product's relative error stays below twice the operand bound plus that
        bound = 2 * 2**-4 + 2**-8 if row["impl"] == "fp8" else 3 * 2**-8
        assert 0 < error < bound, row
    assert (tmp_path / "fp8_gemm_tiny.md").read_text().count("| linear |") == 1
