"""benchmark/bench_fp8_convergence.py --tiny on the CPU: both runs' losses per step, FP8's apart from bf16's by no
more than e4m3's rounding allows, the summary's end losses and relative difference computed from them, and a run
out of budget stopping after one step each."""

import csv
import importlib.util
import os
import statistics
import sys

import pytest

from liger_dspine.ops import fp8_quantize

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "benchmark"))  # the script's own imports (bench_deepseek_v3)

# e4m3 keeps 3 mantissa bits: each operand of an FP8 GEMM rounds by up to 2^-4 relative, its bf16 output by 2^-8; a
# step's loss, from the same weights and batch, stays within one such GEMM's bound of bf16's
PRODUCT_BOUND = 2 * 2**-4 + 2**-8


@pytest.fixture
def reference_quantisers(monkeypatch):
    """The quantisers' torch references, bit-identical to their Triton kernels (test_fp8_quantize.py) and 4x faster
    than them in the interpreter."""
    monkeypatch.setattr(fp8_quantize, "_use_kernel", lambda x: False)


def run_script(*argv) -> int:
    path = os.path.join(ROOT, "benchmark", "bench_fp8_convergence.py")
    spec = importlib.util.spec_from_file_location("bench_fp8_convergence", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(["--tiny", *argv])


def losses(path) -> tuple[list[int], list[float], list[float]]:
    with open(path) as handle:
        rows = list(csv.DictReader(handle))
    return [int(r["step"]) for r in rows], [float(r["bf16_loss"]) for r in rows], [float(r["fp8_loss"]) for r in rows]


def summary_row(markdown: str) -> dict[str, str]:
    header, _, values = markdown.splitlines()[:3]
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in (header, values)]
    return dict(zip(*cells))


def test_tiny_run_writes_both_loss_curves_and_the_goal(tmp_path, reference_quantisers):
    assert run_script("--steps", "3", "--out", str(tmp_path)) == 0
    steps, bf16, fp8 = losses(tmp_path / "fp8_convergence_tiny.csv")
    assert steps == [0, 1, 2]
    for b, f in zip(bf16, fp8):
        assert b != f and abs(f - b) <= PRODUCT_BOUND * b, (b, f)  # FP8's rounding, and only that
    assert bf16[-1] < bf16[0] and fp8[-1] < fp8[0]  # both learn

    markdown = (tmp_path / "fp8_convergence_tiny.md").read_text()
    row = summary_row(markdown)
    assert row["steps"] == "3" and row["goal"] == "0.5%"
    # the end loss: the mean of the last 20 steps, here all three (the CSV keeps 6 decimals, the table 4)
    assert float(row["bf16 end loss"]) == pytest.approx(statistics.mean(bf16), abs=1e-4)
    assert float(row["FP8 end loss"]) == pytest.approx(statistics.mean(fp8), abs=1e-4)
    difference = (statistics.mean(fp8) - statistics.mean(bf16)) / statistics.mean(bf16)
    assert float(row["relative difference"].rstrip("%")) == pytest.approx(100 * difference, abs=2e-3)
    assert row["result"] == ("pass" if abs(difference) < 0.005 else "fail")
    assert float(row["bf16 tokens/s"].replace(",", "")) > 0 and row["bf16 peak GiB"] == "-"  # no CUDA peak on a CPU
    assert "Stopped early" not in markdown


def test_a_run_out_of_budget_stops_after_one_step_each_and_says_so(tmp_path, reference_quantisers):
    run_script("--steps", "3", "--budget-s", "0", "--out", str(tmp_path))
    steps, bf16, fp8 = losses(tmp_path / "fp8_convergence_tiny.csv")
    assert steps == [0] and len(fp8) == 1
    markdown = (tmp_path / "fp8_convergence_tiny.md").read_text()
    assert summary_row(markdown)["steps"] == "1"
    assert "Stopped early (--budget-s 0): 1 of 3 steps." in markdown


def test_a_corpus_of_files_gives_seeded_windows_of_their_bytes_in_path_order(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "bench_fp8_convergence", os.path.join(ROOT, "benchmark", "bench_fp8_convergence.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (tmp_path / "b.txt").write_bytes(bytes(range(100, 200)))
    (tmp_path / "a.txt").write_bytes(bytes(range(0, 100)))
    batches = module.text_batches(str(tmp_path / "*.txt"), seq_len=8, batch_size=3, steps=4, seed=0)
    again = module.text_batches(str(tmp_path / "*.txt"), seq_len=8, batch_size=3, steps=4, seed=0)
    assert len(batches) == 4 and all(b.shape == (3, 8) for b in batches)
    for batch, same in zip(batches, again):
        assert batch.equal(same)
        for row in batch.tolist():  # a window of a.txt then b.txt: consecutive byte values
            assert row == list(range(row[0], row[0] + 8))
    with pytest.raises(SystemExit, match="matches no file"):
        module.text_batches(str(tmp_path / "*.md"), seq_len=8, batch_size=1, steps=1, seed=0)
