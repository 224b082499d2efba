"""``benchmark/bench_dspine.py --tiny``: the DSpine benchmark's plumbing on CPU (one process per configuration, CSV
and markdown report). Its times are not speeds here; native and liger-dspine must compute the same numbers."""

import csv
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the DSpine benchmark's three parts through the interpreter: minutes: make test-slow

SCRIPT = Path(__file__).resolve().parents[3] / "benchmark" / "bench_dspine.py"


def run(out, name, *args):
    command = [sys.executable, str(SCRIPT), "--tiny", "--iters", "1", "--out-dir", str(out), "--name", name, *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(out / f"{name}.csv") as handle:
        return list(csv.DictReader(handle)), (out / f"{name}.md").read_text()


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("bench_dspine")


def by(rows, key):
    return {(row["config"], row["impl"], row["mode"]): float(row[key]) for row in rows if row[key]}


def test_objective_alone_eager_and_fused_agree(out):
    rows, table = run(out, "objective", "--part", "objective")
    assert {(r["config"], r["impl"]) for r in rows} == {
        (f"objective-{h}", impl) for h in (32, 48) for impl in ("native", "fused-objective", "liger-dspine")
    }
    assert all(r["status"] == "ok" for r in rows)
    losses = by(rows, "loss")
    for hidden in (32, 48):
        config = f"objective-{hidden}"
        native = losses[(config, "native", "")]
        for impl in ("fused-objective", "liger-dspine"):
            fused = losses[(config, impl, "")]
            assert abs(fused - native) <= 1e-5 * abs(native), (config, impl, native, fused)
    assert "speed vs native" in table and "memory vs native" in table
    assert all(float(r["speedup"]) > 0 for r in rows)


def test_whole_step_variants_agree(out):
    # accumulation over two micro-batches: the window's prepass and replay as well as the step
    rows, table = run(out, "step", "--part", "step", "--variants", "native,fused-objective", "--modes", "acc2")
    assert {(r["config"], r["impl"]) for r in rows} == {("step-acc2", impl) for impl in ("native", "fused-objective")}
    assert all(r["status"] == "ok" for r in rows)
    losses = by(rows, "loss")
    # same weights, batches and draws: the same loss after the same AdamW steps
    native, fused = losses[("step-acc2", "native", "acc2")], losses[("step-acc2", "fused-objective", "acc2")]
    assert abs(fused - native) <= 1e-5 * abs(native), (native, fused)


def test_accuracy_against_fp32(out):
    rows, table = run(out, "accuracy", "--part", "accuracy")
    assert [r["impl"] for r in rows] == ["native", "liger-layers", "fused-objective", "liger-dspine"]
    # --tiny runs in fp32: every variant is the fp32 reference up to kernel rounding
    for row in rows:
        assert float(row["grad_rel_l2"]) < 1e-5 and float(row["loss_rel_err"]) < 1e-5, row
    assert "gradient rel. L2" in table
