"""DeepSeek-V3 training-step benchmark on one GPU: native transformers ("hf"), liger-kernel ("liger") and
liger-dspine ("liger-dspine"), on DeepSeek-V3 at its real widths with fewer layers and 16 routed experts.

Every configuration runs in a process of its own (clean peak memory, a fresh Triton cache); this parent starts
them one after another, keeps inside a time budget, and writes <out-dir>/<name>.csv, <name>.md and two plots.
A throughput configuration: two warm-ups (the first timed from the built model: first_step_s), then the mean of
three timed steps; peak memory over the timed steps. The longest-sequence sweep (2 layers) builds the model once
per implementation and takes one timed step per length: doubling from 32768 until out of memory, then bisection
to a multiple of 8192.
MFU: model FLOPs (flops.py) per measured step over the bf16 matrix rate measured first, in the same run.

    python benchmark/bench_deepseek_v3.py --suite quick
    python benchmark/bench_deepseek_v3.py --suite full --part 1      # then --part 2
    python benchmark/bench_deepseek_v3.py --suite custom --impls liger-dspine --options '{"swiglu": false}'
    python benchmark/bench_deepseek_v3.py --suite quick --tiny      # CPU plumbing check: tiny model, fp32, interpreter
"""

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from dataclasses import field

from flops import train_step_flops
from report import markdown_report
from report import write_rows

logger = logging.getLogger("bench_deepseek_v3")
_PROCESS_START = time.monotonic()

# Real DeepSeek-V3 widths; depth and routed experts slimmed to fit one GPU.
REAL_WIDTHS = dict(
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_attention_heads=128,
    num_key_value_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
)
SLIM = dict(
    first_k_dense_replace=1,
    n_routed_experts=16,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=1.0,
    n_shared_experts=1,
)

IMPLS = ("hf", "liger", "liger-dspine")
# (layers, seq) per suite part; "sweep" adds the longest-sequence search at 2 layers.
SUITES = {
    "quick": [dict(shapes=[(2, 4096), (2, 16384), (8, 4096)], sweep=False)],
    "full": [
        dict(shapes=[(2, 4096), (2, 8192), (2, 16384), (2, 32768)], sweep=False),
        dict(shapes=[(8, 4096)], sweep=True),
    ],
}
SWEEP = dict(start=32768, step=8192, stop=262144)
# --tiny maps the real shapes onto CPU-sized ones (the interpreter is ~500x slower than eager).
TINY_SEQ = {4096: 16, 7168: 20, 8192: 24, 16384: 32, 32768: 48}
TINY_LAYERS = {2: 2, 8: 3}
TINY_SWEEP = dict(start=32, step=16, stop=128, simulate_oom_above=64)
MIN_CHILD_S = 45  # a configuration is not started with less time than this left in the budget


@dataclass
class Job:
    kind: str  # "matmul", "throughput" or "max_seq"
    impl: str = "matmul"  # "hf", "liger" or "liger-dspine"
    label: str = "matmul"  # the CSV's impl column: the impl, or a variant's name
    layers: int = 0
    seq: int = 0
    options: dict = field(default_factory=dict)
    model: str = "deepseek_v3"  # or a model type of family_configs.FAMILY

    def __str__(self) -> str:
        model = "" if self.model == "deepseek_v3" else f"{self.model} "
        return f"{self.kind} {model}{self.label} {self.layers}L/{self.seq}"


# ---------------------------------------------------------------------------------------------------------------
# Parent: the suite, one child process per job, the CSV, the tables and the plots.


def build_jobs(args) -> list[Job]:
    impls = _impl_list(args)
    if args.suite == "custom":
        shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",") if s]
        parts = [dict(shapes=shapes, sweep=args.max_seq)]
    else:
        parts = SUITES[args.suite]
        if args.suite == "full" and args.part:
            parts = [parts[args.part - 1]]
    jobs = [Job("matmul")]
    for part in parts:
        for layers, seq in part["shapes"]:
            if args.tiny:
                layers, seq = TINY_LAYERS.get(layers, layers), TINY_SEQ.get(seq, seq)
            jobs += [Job("throughput", impl, label, layers, seq, options) for impl, label, options in impls]
        if part["sweep"]:
            # the peers first: their searches end at their memory limit, the rest of the time goes to liger-dspine's
            sweep_order = sorted(impls, key=lambda i: ("liger", "hf", "liger-dspine").index(i[0]))
            jobs += [Job("max_seq", impl, label, 2, 0, options) for impl, label, options in sweep_order]
    return jobs


def _impl_list(args) -> list[tuple[str, str, dict]]:
    """(impl, label, patch options) per implementation measured; --variant adds liger-dspine with other options."""
    impls = []
    for impl in [i.strip() for i in args.impls.split(",") if i.strip()]:
        if impl not in IMPLS:
            raise SystemExit(f"unknown implementation {impl!r}; choose from {', '.join(IMPLS)}")
        impls.append((impl, impl, json.loads(args.options) if impl == "liger-dspine" else {}))
    for variant in args.variant:
        label, _, options = variant.partition("=")
        impls.append(("liger-dspine", label, json.loads(options)))
    return impls


def run_suite(args) -> int:
    name = args.name or (f"{args.suite}{args.part}" if args.suite == "full" and args.part else args.suite)
    if args.tiny:
        name = f"tiny_{name}"
    os.makedirs(args.out_dir, exist_ok=True)
    csv_path = os.path.join(args.out_dir, f"{name}.csv")
    jobs = build_jobs(args)
    logger.info("suite %s: %d processes, budget %.0f s, results in %s", name, len(jobs), args.budget_s, csv_path)
    rows: list[dict] = []
    timed_out: set[str] = set()  # labels whose run was killed: a hang (e.g. autotuning) would repeat
    for number, job in enumerate(jobs, 1):
        remaining = args.budget_s - (time.monotonic() - _PROCESS_START)
        if remaining < MIN_CHILD_S:
            logger.warning("skipping %s: %.0f s left in the budget", job, remaining)
            rows.append(_job_row(job, status="skipped: time budget"))
        elif job.label in timed_out:
            logger.warning("skipping %s: an earlier run of %s timed out", job, job.label)
            rows.append(_job_row(job, status="skipped: an earlier run timed out"))
        else:
            if job.kind == "max_seq":  # a sweep runs until its time is up: an equal share of what is left
                later = jobs[number:]
                sweeps = 1 + sum(j.kind == "max_seq" for j in later)
                reserve = (MIN_CHILD_S + 15) * sum(j.kind != "max_seq" for j in later)
                timeout = max((remaining - 5 - reserve) / sweeps, MIN_CHILD_S - 5)
            else:
                timeout = min(args.child_timeout_s, remaining - 5)
            logger.info("[%d/%d] %s (timeout %.0f s)", number, len(jobs), job, timeout)
            new_rows = run_child(job, timeout, args)
            if job.kind == "throughput" and any(r["status"].startswith("timeout") for r in new_rows):
                timed_out.add(job.label)
            rows += new_rows
        _add_mfu(rows)
        write_rows(csv_path, rows)
    report = markdown_report(rows)
    with open(os.path.join(args.out_dir, f"{name}.md"), "w") as handle:
        handle.write(report)
    print(report, flush=True)
    if not args.no_plots:
        _plot(rows, args.out_dir, f"{name}_")
    logger.info("wrote %s (%.0f s in all)", csv_path, time.monotonic() - _PROCESS_START)
    return 0


def run_child(job: Job, timeout: float, args) -> list[dict]:
    """Run one job in a fresh process with a fresh Triton cache; its rows, or one row saying why there are none."""
    cache_dir = tempfile.mkdtemp(prefix="bench-triton-cache-")
    result_file = os.path.join(cache_dir, "result.jsonl")
    flags = dict(
        child=job.kind,
        model=job.model,
        impl=job.impl,
        label=job.label,
        layers=job.layers,
        seq=job.seq,
        options=json.dumps(job.options),
        result_file=result_file,
        warmup=args.warmup,
        steps=args.steps,
        time_budget_s=timeout - 10,
        sweep_start=args.sweep_start,
        sweep_step=args.sweep_step,
    )
    command = [sys.executable, os.path.abspath(__file__)]
    command += [item for key, value in flags.items() for item in (f"--{key.replace('_', '-')}", str(value))]
    if args.tiny:
        command.append("--tiny")
    env = dict(os.environ, TRITON_CACHE_DIR=cache_dir, PYTHONUNBUFFERED="1")
    if job.impl == "liger":
        env["LIGER_FUSED_MOE_AUTOTUNE"] = "0"  # as in the anchors: autotuning does not finish in 200 s
    if args.tiny:
        env["LIGER_DSPINE_INTERPRET"] = "1"
    started = time.monotonic()
    status = None
    try:
        completed = subprocess.run(command, env=env, timeout=timeout)
        if completed.returncode != 0:
            status = f"crashed: exit code {completed.returncode}"
    except subprocess.TimeoutExpired:
        status = f"timeout: killed after {timeout:.0f} s"
    rows = _read_jsonl(result_file)
    shutil.rmtree(cache_dir, ignore_errors=True)
    logger.info("%s: %d row(s), %.1f s", job, len(rows), time.monotonic() - started)
    if status and not any(r["status"] != "ok" for r in rows):
        seq = job.seq
        if job.kind == "max_seq":  # where the sweep was when it stopped
            sweep = _sweep(args)
            seq = max(r["seq"] for r in rows) + sweep["step"] if rows else sweep["start"]
        rows.append(_job_row(job, seq=seq, status=status))
    return rows


def _job_row(job: Job, **values) -> dict:
    row = dict(kind=job.kind, impl=job.label, layers=job.layers, seq=job.seq, options=json.dumps(job.options))
    row["model"] = job.model
    row.update(values)
    return row


def _read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _add_mfu(rows: list[dict]) -> None:
    rates = [r["model_tflops"] for r in rows if r["kind"] == "matmul" and r.get("status") == "ok"]
    for row in rows:
        if row["kind"] == "matmul" or not row.get("step_ms") or not row.get("flops_per_step"):
            continue
        row["model_tflops"] = row["flops_per_step"] / (row["step_ms"] / 1e3) / 1e12
        row["mfu"] = row["model_tflops"] / rates[-1] if rates else None


def _plot(rows: list[dict], out_dir: str, prefix: str) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        logger.warning("matplotlib is missing: run benchmark/plot.py on the CSV where it is installed")
        return
    from plot import make_plots

    for path in make_plots(rows, out_dir, prefix):
        logger.info("wrote %s", path)


# ---------------------------------------------------------------------------------------------------------------
# Child: one job in this process.


def child_main(args) -> int:
    if args.tiny:
        os.environ["LIGER_DSPINE_INTERPRET"] = "1"
        import liger_dspine  # noqa: F401  (switches the interpreter on before any kernel module is imported)
    import torch

    base = dict(kind=args.child, impl=args.label, layers=args.layers, seq=args.seq, options=args.options)
    base["model"] = args.model
    bench = ChildBench(args, torch)
    try:
        if args.child == "matmul":
            bench.matmul(base)
        elif args.child == "throughput":
            bench.throughput(base)
        else:
            bench.max_seq(base)
    except Exception as error:  # a row that says what went wrong, then the traceback in the log
        _emit(args.result_file, dict(base, status=f"error: {type(error).__name__}: {str(error)[:300]}"))
        raise
    return 0


class ChildBench:
    """Builds the model for one configuration and times training steps on it."""

    def __init__(self, args, torch):
        self.args = args
        self.torch = torch
        self.cuda = not args.tiny
        self.device = "cuda" if self.cuda else "cpu"
        self.dtype = torch.bfloat16 if self.cuda else torch.float32

    # -- jobs

    def matmul(self, base: dict) -> None:
        """The bf16 matrix rate of this GPU (random 8192^3 products): the MFU denominator."""
        torch = self.torch
        n = 8192 if self.cuda else 256
        a = torch.randn(n, n, device=self.device, dtype=self.dtype)
        b = torch.randn(n, n, device=self.device, dtype=self.dtype)
        for _ in range(3):
            a @ b
        seconds = self._time(lambda: a @ b, repeats=20) / 20
        tflops = 2 * n**3 / seconds / 1e12
        logger.info("matrix rate %d^3 %s: %.1f TFLOP/s", n, self.dtype, tflops)
        _emit(
            self.args.result_file,
            dict(base, status="ok", model_tflops=tflops, step_ms=seconds * 1e3, device=self._device_name()),
        )

    def throughput(self, base: dict) -> None:
        """Warm-ups (the first one timed from a built model and a cold Triton cache), then the mean of timed steps."""
        torch, args = self.torch, self.args
        row = dict(base, device=self._device_name())
        try:
            model, config = self._build(row, args.seq)
            input_ids = self._input_ids(config, args.seq)
            row["first_step_s"] = self._time(lambda: self._train_step(model, input_ids))
            for _ in range(args.warmup - 1):
                self._train_step(model, input_ids)
            self._reset_peak()
            losses = []
            step_s = self._time(lambda: losses.append(self._train_step(model, input_ids)), repeats=args.steps)
            row.update(self._step_values(args.seq, step_s / args.steps, float(losses[-1])), status="ok")
        except torch.cuda.OutOfMemoryError as error:
            logger.warning("out of memory: %s", str(error).splitlines()[0])
            row["status"] = "oom"
        _emit(args.result_file, row)

    def max_seq(self, base: dict) -> None:
        """2 layers, one timed step per sequence length: doubling from the sweep's start until out of memory, then
        bisection on the sweep's step between the longest length that ran and the shortest that did not."""
        sweep = _sweep(self.args)
        step = sweep["step"]
        state = dict(model=None, config=None, base=base, last=None)  # last: (seq, step seconds)
        fits, fails = None, None
        seq = sweep["start"]
        while seq is not None:
            ran = self._max_seq_try(seq, state, sweep)
            if ran is None:  # out of time
                return
            if ran:
                fits = seq
            else:
                fails = seq
            if fails is None:
                seq = seq * 2 if seq * 2 <= sweep["stop"] else None
            elif fits is None or fails - fits <= step:
                seq = None
            else:
                seq = fits + max(step, (fails - fits) // 2 // step * step)

    def _max_seq_try(self, seq: int, state: dict, sweep: dict) -> bool | None:
        """One timed step at seq: True (ran), False (out of memory), None (skipped: not enough time left)."""
        torch, args = self.torch, self.args
        row = dict(state["base"], seq=seq, device=self._device_name())
        last = state["last"]
        elapsed = time.monotonic() - _PROCESS_START
        if last and elapsed + 1.5 * last[1] * (seq / last[0]) ** 2 > args.time_budget_s:
            row["status"] = "skipped: time budget"
            _emit(args.result_file, row)
            return None
        model = state["model"]
        try:
            if model is None:
                model, config = self._build(row, sweep["stop"])
                state.update(model=model, config=config)
                keys = ("params", "build_s", "attn", "experts", "moe_autotune")
                state["base"] = dict(state["base"], **{k: row[k] for k in keys})
                warm_ids = self._input_ids(config, sweep["start"])
                row["first_step_s"] = self._time(lambda: self._train_step(model, warm_ids))
                del warm_ids
            if seq > sweep.get("simulate_oom_above", seq):
                raise torch.cuda.OutOfMemoryError(f"simulated: {seq} > {sweep['simulate_oom_above']} (--tiny)")
            input_ids = self._input_ids(state["config"], seq)
            self._reset_peak()
            losses = []
            step_s = self._time(lambda: losses.append(self._train_step(model, input_ids)))
            row.update(self._step_values(seq, step_s, float(losses[-1])), status="ok")
            state["last"] = (seq, step_s)
            ran = True
        except torch.cuda.OutOfMemoryError as error:
            logger.warning("out of memory at %d: %s", seq, str(error).splitlines()[0])
            row["status"] = "oom"
            ran = False
        if not ran:  # free what the failed step left (partial gradients, the traceback's tensors) before the next
            model.zero_grad(set_to_none=True)
            if self.cuda:
                torch.cuda.empty_cache()
        _emit(args.result_file, row)
        return ran

    # -- pieces

    def _build(self, row: dict, max_seq: int):
        """Patch (liger / liger-dspine), then build the model directly on the device in the benchmark dtype."""
        torch, args = self.torch, self.args
        _apply_patch(args.impl, json.loads(args.options), args.model)
        config = model_config(args.model, args.layers, args.tiny, max_seq)
        started = time.monotonic()
        torch.manual_seed(0)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = model_class(args.model)(config)
        finally:
            torch.set_default_dtype(previous)
        model.train()
        self._sync()
        row.update(
            params=sum(p.numel() for p in model.parameters()),
            build_s=time.monotonic() - started,
            attn=model.config._attn_implementation,
            experts=getattr(model.config, "_experts_implementation", None) or "",
            moe_autotune=os.environ.get("LIGER_FUSED_MOE_AUTOTUNE", "default"),  # as the patch left it
        )
        logger.info(
            "built in %.1f s: %s parameters, attn %s, experts %s, MoE autotune %s",
            row["build_s"],
            f"{row['params']:,}",
            row["attn"],
            row["experts"],
            row["moe_autotune"],
        )
        return model, config

    def _input_ids(self, config, seq: int):
        generator = self.torch.Generator().manual_seed(1)
        ids = self.torch.randint(0, config.vocab_size, (1, seq), generator=generator)
        return ids.to(self.device)

    @staticmethod
    def _train_step(model, input_ids):
        """Forward + backward with labels = input_ids, then the gradients set to None (no optimizer)."""
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.detach()

    def _step_values(self, seq: int, step_s: float, loss: float) -> dict:
        config = model_config(self.args.model, self.args.layers, self.args.tiny, seq)
        peak = self.torch.cuda.max_memory_allocated() / 2**30 if self.cuda else None
        return dict(
            step_ms=step_s * 1e3,
            tokens_per_s=seq / step_s,
            peak_gib=peak,
            loss=loss,
            flops_per_step=train_step_flops(config, 1, seq),
        )

    def _time(self, work, repeats: int = 1) -> float:
        """Seconds for ``repeats`` calls of work: CUDA events on the GPU, a synchronized wall clock for one call."""
        torch = self.torch
        if not self.cuda or repeats == 1:
            self._sync()
            started = time.perf_counter()
            for _ in range(repeats):
                work()
            self._sync()
            return time.perf_counter() - started
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self._sync()
        start.record()
        for _ in range(repeats):
            work()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def _sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def _reset_peak(self) -> None:
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()

    def _device_name(self) -> str:
        return self.torch.cuda.get_device_name() if self.cuda else "cpu"


def deepseek_v3_config(layers: int, tiny: bool, max_seq: int):
    """The benchmarked model; ``tiny``: the tests' tiny DeepSeek-V3 (test/tiny_models.py) at the same depth."""
    if tiny:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "test"))
        from tiny_models import tiny_deepseek_v3_config

        return tiny_deepseek_v3_config(
            num_hidden_layers=layers, max_position_embeddings=max(max_seq, 4096), attn_implementation=None
        )
    from transformers import DeepseekV3Config

    return DeepseekV3Config(num_hidden_layers=layers, max_position_embeddings=max(max_seq, 4096), **REAL_WIDTHS, **SLIM)


def model_config(model: str, layers: int, tiny: bool, max_seq: int):
    if model == "deepseek_v3":
        return deepseek_v3_config(layers, tiny, max_seq)
    from family_configs import family_config

    return family_config(model, layers, tiny, max_seq)


def model_class(model: str):
    if model == "deepseek_v3":
        from transformers.models.deepseek_v3 import modeling_deepseek_v3

        return modeling_deepseek_v3.DeepseekV3ForCausalLM
    from family_configs import family_class

    return family_class(model)


def _apply_patch(impl: str, options: dict, model: str = "deepseek_v3") -> None:
    if impl == "liger":
        from liger_kernel.transformers import monkey_patch

        getattr(monkey_patch, f"apply_liger_kernel_to_{model}")(**options)
        logger.info("liger-kernel %s patch applied (%s)", model, options or "defaults")
    elif impl == "liger-dspine":
        from liger_dspine import registry

        report = registry.apply_fn_for(model)(**options)
        logger.info("liger-dspine %s patch applied (%s): %s", model, options or "defaults", report)


def _sweep(args) -> dict:
    sweep = dict(TINY_SWEEP if args.tiny else SWEEP)
    if args.sweep_start:  # a known-good length: the doubling starts there (saves the short, fast-growing steps)
        sweep["start"] = args.sweep_start
    if getattr(args, "sweep_step", 0):  # the bisection's resolution
        sweep["step"] = args.sweep_step
    return sweep


def _emit(path: str, row: dict) -> None:
    with open(path, "a") as handle:
        handle.write(json.dumps(row) + "\n")


# ---------------------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=("quick", "full", "custom"), default="quick")
    parser.add_argument("--part", type=int, choices=(1, 2), help="with --suite full: one part (each fits 10 min)")
    parser.add_argument("--impls", default=",".join(IMPLS), help="comma list of hf, liger, liger-dspine")
    parser.add_argument("--shapes", default="2x4096", help="--suite custom: LAYERSxSEQ,... e.g. 2x4096,8x4096")
    parser.add_argument("--max-seq", action="store_true", help="--suite custom: add the longest-sequence sweep")
    parser.add_argument("--sweep-start", type=int, default=0, help="first length of the sweep (default 32768)")
    parser.add_argument("--sweep-step", type=int, default=0, help="resolution of the sweep's bisection (default 8192)")
    parser.add_argument(
        "--options", default="{}", help="liger-dspine patch options as JSON, e.g. '{\"swiglu\": false}'"
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL=JSON",
        help="also measure liger-dspine with these options, reported as LABEL (repeatable)",
    )
    parser.add_argument(
        "--tiny",
        "--dry-run",
        action="store_true",
        help="CPU plumbing check: tiny model, fp32, Triton interpreter, tiny shapes",
    )
    parser.add_argument("--budget-s", type=float, default=540, help="stop starting processes past this (seconds)")
    parser.add_argument("--child-timeout-s", type=float, default=150, help="kill one configuration after this")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "data"))
    parser.add_argument("--name", help="file name stem of the CSV / markdown / plots (default: the suite)")
    parser.add_argument("--no-plots", action="store_true")
    # internal: one job in this process
    parser.add_argument("--child", choices=("matmul", "throughput", "max_seq"), help=argparse.SUPPRESS)
    parser.add_argument("--impl", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="deepseek_v3", help=argparse.SUPPRESS)
    parser.add_argument("--label", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--seq", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    parser.add_argument("--time-budget-s", type=float, default=600, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    model = "" if args.model == "deepseek_v3" else f"{args.model} "
    tag = f"[{model}{args.label} {args.child} {args.layers}L/{args.seq}] " if args.child else ""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {tag}%(message)s", datefmt="%H:%M:%S")
    if args.child:
        return child_main(args)
    return run_suite(args)


if __name__ == "__main__":
    sys.exit(main())
