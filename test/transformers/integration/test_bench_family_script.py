"""``benchmark/bench_family.py --tiny``: the DeepSeek-family benchmark's plumbing on CPU. DeepSeek-V2 runs through
all three implementations (one process each) and a ``--variant`` (liger-dspine with other options); a second run adds
GLM-4.7-Flash's liger-kernel row (no patch there: no process) and DeepSeek-V3.2 (skipped with its reason while
liger-dspine or transformers lacks it) to the same CSV; a third adds DeepSeek-V4 at its 3-layer plan, liger-dspine
with its defaults; a fourth adds DeepSeek-V2's longest-sequence sweeps (out of memory simulated above 64 tokens) and
keeps its step rows."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a benchmark run of every family model through the interpreter: minutes: make test-slow

SCRIPT = Path(__file__).resolve().parents[3] / "benchmark" / "bench_family.py"


def _run(out, *extra):
    command = [sys.executable, str(SCRIPT), "--tiny", "--lengths", "4096", "--warmup", "1", "--steps", "1"]
    command += ["--out-dir", str(out), "--no-plots", *extra]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_family")
    _run(out, "--models", "deepseek_v2", "--variant", 'eager_router={"moe_router": false}')
    _run(out, "--models", "glm4_moe_lite,deepseek_v32", "--impls", "liger")
    _run(out, "--models", "deepseek_v4", "--impls", "hf,liger-dspine")
    _run(out, "--models", "deepseek_v2", "--impls", "liger,liger-dspine", "--sweep-only")
    with open(out / "tiny_family.csv") as f:
        rows = list(csv.DictReader(f))
    return rows, (out / "tiny_family.md").read_text()


def test_deepseek_v2_through_every_implementation(tiny_run):
    rows, _ = tiny_run
    steps = {row["impl"]: row for row in rows if row["model"] == "deepseek_v2" and row["kind"] == "throughput"}
    assert sorted(steps) == ["eager_router", "hf", "liger", "liger-dspine"]
    for impl, row in steps.items():
        assert row["status"] == "ok", (impl, row["status"])
        assert (row["layers"], row["seq"]) == ("2", "16"), impl  # --tiny maps 4096 tokens onto 16
        assert float(row["tokens_per_s"]) > 0 and float(row["first_step_s"]) > 0, impl
    losses = [float(row["loss"]) for row in steps.values()]
    assert max(losses) - min(losses) < 1e-4, losses  # same model and batch: the four losses agree
    assert json.loads(steps["eager_router"]["options"]) == {"moe_router": False}
    assert json.loads(steps["liger-dspine"]["options"]) == {}


def test_variant_rows_are_reported_against_the_defaults(tiny_run):
    rows, report = tiny_run
    steps = {row["impl"]: row for row in rows if row["model"] == "deepseek_v2" and row["kind"] == "throughput"}
    variant, base = (float(steps[i]["tokens_per_s"]) for i in ("eager_router", "liger-dspine"))
    line = next(line for line in report.splitlines() if "| eager_router |" in line)
    assert f"| {variant / base:.2f}x |" in line, line
    assert line.startswith("| deepseek_v2 (DeepSeek-V2-Lite-like) | 16 | eager_router |"), line


def test_variant_without_a_new_label_or_json_is_refused(tmp_path):
    for variant, message in (("liger=" + "{}", "needs a new label"), ("x={", "not JSON"), ("x=[1]", "JSON object")):
        command = [sys.executable, str(SCRIPT), "--tiny", "--out-dir", str(tmp_path), "--variant", variant]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert done.returncode != 0 and message in done.stderr, (variant, done.stderr[-500:])


def test_second_run_keeps_the_first_runs_rows_and_says_why_not(tiny_run):
    rows, report = tiny_run
    glm = [row for row in rows if row["model"] == "glm4_moe_lite"]
    assert [row["status"] for row in glm] == ["unsupported: liger-kernel has no patch for this model"]
    v32 = [row for row in rows if row["model"] == "deepseek_v32"]
    assert len(v32) == 1 and v32[0]["status"].startswith(("skipped: ", "unsupported: ")), v32
    assert "| deepseek_v2 (DeepSeek-V2-Lite-like) | 16 |" in report
    assert "liger-dspine/hf speed" in report and "liger-dspine/liger peak" in report and "deepseek_v2 goals:" in report


def test_deepseek_v4_runs_its_layer_plan_with_the_defaults(tiny_run):
    """liger-dspine's defaults, which for V4 include the attention kernel and the hyper-connection kernels."""
    rows, report = tiny_run
    steps = {row["impl"]: row for row in rows if row["model"] == "deepseek_v4" and row["kind"] == "throughput"}
    if not steps or steps.get("-"):
        pytest.skip("this transformers has no deepseek_v4")
    assert sorted(steps) == ["hf", "liger-dspine"]
    for impl, row in steps.items():
        assert row["status"] == "ok", (impl, row["status"])
        assert (row["layers"], row["seq"]) == ("3", "16"), impl
    assert steps["liger-dspine"]["options"] == steps["hf"]["options"] == "{}"
    assert abs(float(steps["liger-dspine"]["loss"]) - float(steps["hf"]["loss"])) < 1e-4
    assert "deepseek_v4 goals: speed >= 1.5x hf" in report


def test_sweep_finds_the_longest_sequence_and_keeps_the_step_rows(tiny_run):
    """Doubling from 32 tokens (the tiny sweep's start) until out of memory, then bisection to 16 tokens."""
    rows, report = tiny_run
    sweeps = [row for row in rows if row["model"] == "deepseek_v2" and row["kind"] == "max_seq"]
    for impl in ("liger", "liger-dspine"):
        mine = {int(row["seq"]): row["status"] for row in sweeps if row["impl"] == impl}
        assert mine == {32: "ok", 64: "ok", 128: "oom", 96: "oom", 80: "oom"}, (impl, mine)
    assert sum(row["kind"] == "throughput" for row in rows if row["model"] == "deepseek_v2") == 4
    assert "| deepseek_v2 (DeepSeek-V2-Lite-like) | liger-dspine | 64 | 80 |" in report
    assert "deepseek_v2 longest sequence: 1.00x liger's" in report
