"""DSpine training benchmark on one GPU: native transformers against liger-dspine, side by side in one run.

Parts (each configuration runs in a process of its own, for a clean peak memory and a fresh Triton cache):
- ``objective``: the objective alone, from the drafter's outputs to the loss and its backward
  (``DSpineObjective.block_terms``), eager (chunks of 128 blocks under checkpointing) against the fused kernel (with
  the native drafter's refinement modules, and with the Liger ones), at
  hidden 4096 / vocab 151936 (Qwen3-8B target) and hidden 7168 / vocab 129280 (DeepSeek-V3 target). Reports the
  fraction of the GEMM floor (three [R, H] x [H, V] products at the bf16 matmul rate measured in the same process),
  and the same at the highest rate any process of the run measured (run_floor_fraction: one floor for every row).
- ``step``: a whole training step (forward, backward, AdamW) of a Qwen3-8B-like drafter (5 layers, hidden 4096,
  32 / 8 heads, vocab 151936, block 16, 512 anchors, batch 2, context 3072, sdpa) in four variants: native, Liger
  layers only, fused objective only, both; with accumulation 1, accumulation 2 (CE-only prepasses, then replays)
  and gradient checkpointing.
- ``accuracy``: the loss and parameter gradients of one step of each variant in bf16 against an fp32 run of the same
  weights and batch: relative L2 error of the whole flattened gradient, and the worst single tensor.

Times: CUDA events, median of the timed calls after two warm-ups (the first is timed from the built model:
first_call_s). Memory: the peak above what was allocated before the call (weights, optimizer state, inputs).

    python benchmark/bench_dspine.py --part all
    python benchmark/bench_dspine.py --part objective --name dspine_objective
    python benchmark/bench_dspine.py --part all --tiny     # CPU plumbing check: tiny widths, fp32, interpreter
"""

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

STEP_VARIANTS = {  # name -> (Liger layers, fused objective)
    "native": (False, False),
    "liger-layers": (True, False),
    "fused-objective": (False, True),
    "liger-dspine": (True, True),
}
# the objective alone: eager; fused with the native drafter's modules in the refinement (its final norm and
# injection); fused with the Liger ones, as apply_liger_kernel_to_dspine() leaves a drafter
OBJECTIVE_VARIANTS = ("native", "fused-objective", "liger-dspine")
STEP_MODES = ("acc1", "acc2", "ckpt")
OBJECTIVE_WIDTHS = ((4096, 151936), (7168, 129280))
TINY_OBJECTIVE_WIDTHS = ((32, 3000), (48, 2000))
FIELDS = [
    "part", "config", "impl", "mode", "hidden", "vocab", "rows", "status", "median_ms", "first_call_s", "peak_gib",
    "speedup", "memory_ratio", "gemm_floor_ms", "floor_fraction", "matmul_tflops", "run_floor_fraction", "loss",
    "loss_rel_err", "grad_rel_l2", "worst_tensor", "worst_tensor_rel_l2", "error",
]  # fmt: skip


# ------------------------------------------------------------------------------------------------------ set-ups
def draft_config(hidden, vocab, layers, tiny):
    from liger_dspine.models.dspine import DSpineDraftConfig

    if tiny:
        heads, kv, head_dim, inter, rank, msg, top_k, block = 4, 2, hidden // 4, 2 * hidden, 8, 4, 4, 4
    else:
        heads, kv, head_dim, inter, rank, msg, top_k, block = hidden // 128, 8, 128, 3 * hidden, 1024, 512, 16, 16
    return DSpineDraftConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        vocab_size=vocab,
        max_position_embeddings=8192,
        rms_norm_eps=1e-6,
        block_size=block,
        num_target_layers=36,
        dflash_config={"mask_token_id": vocab - 1, "target_layer_ids": [1, 9, 17, 25, 33]},
        dspine_config={"transfer_rank": rank, "message_size": msg, "top_k": top_k, "ce_weight": 0.1},
        attn_implementation="sdpa",
    )


def build_objective(hidden, vocab, layers, liger, fused, dtype, device, tiny, seed=0, anchors=512):
    """A drafter and its objective against a random frozen head and embedding (head logits of std about 2)."""
    import torch
    from torch import nn

    from liger_dspine.models.dspine import DSpineDraftModel
    from liger_dspine.models.dspine import DSpineObjective

    torch.manual_seed(seed)
    with torch.device(device):
        head = nn.Linear(hidden, vocab, bias=False)
        nn.init.normal_(head.weight, std=2.0 / hidden**0.5)
        embed = nn.Embedding(vocab, hidden)
        nn.init.normal_(embed.weight, std=0.02)
        draft = DSpineDraftModel(draft_config(hidden, vocab, layers, tiny), use_liger_kernel=liger)
        draft.initialize_transfer_space(head.weight)
        with torch.no_grad():
            for write in draft.injection.writes:
                write.weight.normal_(0.0, 0.05)
    head, embed, draft = (m.to(dtype) for m in (head, embed, draft))
    draft.transfer_codes = draft.transfer_codes.float()
    objective = DSpineObjective(draft, head, embed, num_anchors=anchors, fused_objective=fused)
    return objective.train()


def step_batch(objective, batch, seq, seed, device, dtype):
    import torch

    generator = torch.Generator(device="cpu").manual_seed(seed)
    draft = objective.draft_model
    hidden, taps = draft.config.hidden_size, len(draft.config.dflash_config["target_layer_ids"])
    vocab = draft.config.vocab_size
    loss_mask = torch.ones(batch, seq)
    loss_mask[:, : seq // 8] = 0  # a prompt
    return {
        "input_ids": torch.randint(0, vocab - 1, (batch, seq), generator=generator).to(device),
        "hidden_states": torch.randn(batch, seq, taps * hidden, generator=generator).to(device, dtype),
        "loss_mask": loss_mask.to(device),
        "target_last_hidden_states": torch.randn(batch, seq, hidden, generator=generator).to(device, dtype),
    }


def objective_inputs(objective, blocks, seed, device, dtype):
    """Random drafter outputs for ``block_terms``: M = blocks, P = block - 1 proposals each."""
    import torch

    draft = objective.draft_model
    hidden, vocab = draft.config.hidden_size, draft.config.vocab_size
    proposals, layers = draft.block_size - 1, len(draft.layers)
    rank = objective.dspine_config.transfer_rank
    generator = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(device, dtype)

    hidden_rows = rand(blocks, proposals, hidden)
    decay = torch.exp(-torch.arange(proposals, dtype=torch.float32) / 7.0)
    return dict(
        hidden=hidden_rows.requires_grad_(True),
        pre=rand(blocks, proposals, hidden).requires_grad_(True),
        features=rand(blocks, layers, proposals, rank).requires_grad_(True),
        labels=torch.randint(0, vocab, (blocks, proposals), generator=generator).to(device),
        previous=torch.randint(0, vocab, (blocks, proposals), generator=generator).to(device),
        teacher=(hidden_rows.detach().float() + 0.5 * rand(blocks, proposals, hidden).float()).to(dtype),
        weights=decay.expand(blocks, proposals).contiguous().to(device),
        supervised=torch.ones(blocks, proposals, dtype=torch.bool, device=device),
    )


# ----------------------------------------------------------------------------------------------------- measuring
class Timer:
    def __init__(self, device):
        self.device = device

    def sync(self):
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()

    def time_ms(self, fn):
        import torch

        if self.device != "cuda":
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return begin.elapsed_time(end)


def measure(fn, device, iters, warmup=2):
    """(median ms, first call s, peak GiB above the allocation before each call)."""
    import torch

    timer = Timer(device)
    timer.sync()
    start = time.perf_counter()
    fn()
    timer.sync()
    first = time.perf_counter() - start
    for _ in range(warmup - 1):
        fn()
    times, peaks = [], []
    for _ in range(iters):
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        times.append(timer.time_ms(fn))
        if device == "cuda":
            peaks.append((torch.cuda.max_memory_allocated() - base) / 2**30)
    return statistics.median(times), first, max(peaks) if peaks else float("nan")


def matmul_tflops(device, dtype):
    """The bf16 matmul rate of this device, measured on an 8192^3 product (median of 10)."""
    import torch

    if device != "cuda":
        return float("nan")
    a = torch.randn(8192, 8192, device=device, dtype=dtype)
    b = torch.randn(8192, 8192, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    timer = Timer(device)
    ms = statistics.median(timer.time_ms(lambda: a @ b) for _ in range(10))
    return 2 * 8192**3 / (ms * 1e-3) / 1e12


# ------------------------------------------------------------------------------------------------ the parts
def run_objective(args, hidden, vocab, impl):
    import torch

    device, dtype = args.device, args.dtype
    liger, fused = STEP_VARIANTS[impl]
    objective = build_objective(hidden, vocab, 1, liger, fused, dtype, device, args.tiny)
    blocks = args.batch * args.anchors
    inputs = objective_inputs(objective, blocks, 11, device, dtype)
    leaves = [inputs[k] for k in ("hidden", "pre", "features")]

    def call():
        for leaf in leaves:
            leaf.grad = None
        backbone, ce, l1, ref, align, correct, coverage = objective.block_terms(**inputs)
        (backbone + ref + 0.5 * align).backward()

    median_ms, first_s, peak = measure(call, device, args.iters)
    rows = blocks * (objective.block_size - 1)
    tflops = matmul_tflops(device, dtype)
    floor_ms = 3 * 2 * rows * hidden * vocab / (tflops * 1e12) * 1e3
    with torch.no_grad():
        backbone, _, _, ref, align, _, _ = objective.block_terms(**inputs)
        loss = (backbone + ref + 0.5 * align).item()
    accuracy = objective_accuracy(args, objective, inputs, leaves, hidden, vocab)
    return dict(**accuracy,
        median_ms=median_ms, first_call_s=first_s, peak_gib=peak, rows=rows, gemm_floor_ms=floor_ms,
        floor_fraction=floor_ms / median_ms, loss=loss, matmul_tflops=tflops,
    )  # fmt: skip


def objective_accuracy(args, objective, inputs, leaves, hidden, vocab):
    """The last call's input gradients against the eager objective in fp32 on the same (rounded) inputs.

    grad_rel_l2 is the draft rows' gradient (the backbone CE and L1, what the fused kernel computes); the worst
    tensor is over the draft rows, the pre-injection states (refinement) and the layer features (alignment).
    """
    import torch

    names = ("hidden", "pre", "features")
    grads = [leaf.grad.float() for leaf in leaves]
    reference = build_objective(hidden, vocab, 1, False, False, torch.float32, args.device, args.tiny)
    ref_inputs = {
        k: v.detach().float().requires_grad_(k in names) if v.is_floating_point() else v for k, v in inputs.items()
    }
    backbone, _, _, ref, align, _, _ = reference.block_terms(**ref_inputs)
    (backbone + ref + 0.5 * align).backward()
    errors = {
        name: ((grad - ref_inputs[name].grad).norm() / ref_inputs[name].grad.norm()).item()
        for name, grad in zip(names, grads)
    }
    worst = max(errors, key=errors.get)
    return dict(grad_rel_l2=errors["hidden"], worst_tensor=worst, worst_tensor_rel_l2=errors[worst])


def run_step(args, variant, mode):
    import torch

    from liger_dspine.models.dspine import DSpineAccumulationWindow

    device, dtype = args.device, args.dtype
    liger, fused = STEP_VARIANTS[variant]
    objective = build_objective(
        args.hidden, args.vocab, args.layers, liger, fused, dtype, device, args.tiny, anchors=args.anchors
    )
    draft = objective.draft_model
    if mode == "ckpt":
        draft.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-5)
    micro = 2 if mode == "acc2" else 1
    batches = [step_batch(objective, args.batch, args.seq, 100 + i, device, dtype) for i in range(micro)]
    state = {"step": 0}

    def step():
        torch.manual_seed(1000 + state["step"])
        state["step"] += 1
        if micro == 1:
            out = objective(**batches[0], global_step=100, total_steps=1000)
            out.loss.backward()
            loss = out.loss
        else:
            window = DSpineAccumulationWindow(objective, micro, offload_batch=False)
            for batch in batches:
                window.prepass(batch, global_step=100, total_steps=1000)
            outs = window.replay()
            loss = sum(o.loss_terms[0].detach() for o in outs) / sum(o.loss_terms[1] for o in outs)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state["loss"] = loss.detach()

    # AdamW's state exists before the timed calls, so the peak above the allocation is the step's own.
    step()
    median_ms, first_s, peak = measure(step, device, args.iters)
    return dict(median_ms=median_ms, first_call_s=first_s, peak_gib=peak, loss=float(state["loss"]))


def run_accuracy(args):
    """One step's loss and gradients of each variant in the benchmark dtype against fp32 (same weights, batch)."""
    import torch

    device = args.device
    results = []
    reference = build_objective(
        args.hidden, args.vocab, args.layers, False, False, torch.float32, device, args.tiny, anchors=args.anchors
    )
    batch32 = step_batch(reference, args.batch, args.seq, 7, device, torch.float32)
    torch.manual_seed(5)
    out = reference(**batch32, global_step=100, total_steps=1000)
    out.loss.backward()
    ref_loss = out.loss.item()
    ref_grads = {n: p.grad.float() for n, p in reference.draft_model.named_parameters() if p.grad is not None}
    state = {k: v.detach().clone() for k, v in reference.draft_model.state_dict().items()}
    del reference, out
    for variant, (liger, fused) in STEP_VARIANTS.items():
        objective = build_objective(
            args.hidden, args.vocab, args.layers, liger, fused, args.dtype, device, args.tiny, anchors=args.anchors
        )
        objective.draft_model.load_state_dict(
            {k: v.to(objective.draft_model.state_dict()[k].dtype) for k, v in state.items()}
        )
        batch = {k: v.to(args.dtype) if v.is_floating_point() and v.dim() == 3 else v for k, v in batch32.items()}
        torch.manual_seed(5)
        out = objective(**batch, global_step=100, total_steps=1000)
        out.loss.backward()
        grads = {n: p.grad.float() for n, p in objective.draft_model.named_parameters() if p.grad is not None}
        num = sum(((grads[n] - g) ** 2).sum() for n, g in ref_grads.items())
        den = sum((g**2).sum() for g in ref_grads.values())
        per_tensor = {n: ((grads[n] - g).norm() / g.norm().clamp_min(1e-30)).item() for n, g in ref_grads.items()}
        worst = max(per_tensor, key=per_tensor.get)
        results.append(
            dict(
                impl=variant,
                loss=out.loss.item(),
                loss_rel_err=abs(out.loss.item() - ref_loss) / abs(ref_loss),
                grad_rel_l2=(num / den).sqrt().item(),
                worst_tensor=worst,
                worst_tensor_rel_l2=per_tensor[worst],
            )  # fmt: skip
        )
        del objective, out, grads
        if device == "cuda":
            torch.cuda.empty_cache()
    return results


# ------------------------------------------------------------------------------------------------- driver
def child(args) -> int:
    import torch

    args.dtype = torch.float32 if args.tiny else torch.bfloat16
    spec = json.loads(args.child)
    try:
        if spec["part"] == "objective":
            result = [run_objective(args, spec["hidden"], spec["vocab"], spec["impl"])]
        elif spec["part"] == "step":
            result = [run_step(args, spec["impl"], spec["mode"])]
        else:
            result = run_accuracy(args)
        status = "ok"
    except torch.OutOfMemoryError as error:
        result, status = [dict(error=str(error).splitlines()[0])], "oom"
    with open(args.result, "w") as handle:
        json.dump(dict(status=status, rows=result), handle)
    return 0


def configurations(args):
    widths = TINY_OBJECTIVE_WIDTHS if args.tiny else OBJECTIVE_WIDTHS
    parts = ("objective", "step", "accuracy") if args.part == "all" else (args.part,)
    for part in parts:
        if part == "objective":
            chosen = [impl for impl in OBJECTIVE_VARIANTS if impl in args.variants.split(",")]
            for hidden, vocab in widths:
                for impl in chosen:
                    yield dict(part=part, hidden=hidden, vocab=vocab, impl=impl, config=f"objective-{hidden}")
        elif part == "step":
            for mode in args.modes.split(","):
                for variant in args.variants.split(","):
                    yield dict(part=part, impl=variant, mode=mode, config=f"step-{mode}")
        elif part == "accuracy":
            yield dict(part=part, config="accuracy")


def add_ratios(rows):
    """speedup = native median / this median, memory_ratio = this peak / native peak, within a config."""
    native = {(r["config"], r.get("mode")): r for r in rows if r.get("impl") == "native" and r["status"] == "ok"}
    for row in rows:
        base = native.get((row["config"], row.get("mode")))
        if base is None or row["status"] != "ok" or "median_ms" not in row:
            continue
        row["speedup"] = base["median_ms"] / row["median_ms"]
        if base.get("peak_gib") and base["peak_gib"] == base["peak_gib"]:
            row["memory_ratio"] = row["peak_gib"] / base["peak_gib"]


def add_run_floor(rows):
    """run_floor_fraction: the floor at the highest matmul rate measured in any process of the run over the time,
    so that rows measured in processes that clocked the matmul differently share one floor."""
    clocked = [r for r in rows if r.get("status") == "ok" and (r.get("matmul_tflops") or 0) > 0]
    if not clocked:
        return
    best = max(r["matmul_tflops"] for r in clocked)
    for row in clocked:
        if row.get("gemm_floor_ms"):
            row["run_floor_fraction"] = row["gemm_floor_ms"] * row["matmul_tflops"] / best / row["median_ms"]


def markdown(rows) -> str:
    lines = []
    timed = [r for r in rows if r["part"] in ("objective", "step")]
    if timed:
        lines += [
            "| config | impl | median ms | first call s | peak GiB | speed vs native | memory vs native | floor "
            "(at the run's best matmul rate) |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in timed:
            if r["status"] != "ok":
                lines.append(f"| {r['config']} | {r['impl']} | {r['status']} | | | | | |")
                continue
            floor = f"{r['floor_fraction']:.0%}" if r.get("floor_fraction") else ""
            if r.get("run_floor_fraction"):
                floor += f" ({r['run_floor_fraction']:.0%})"
            lines.append(
                f"| {r['config']} | {r['impl']} | {r['median_ms']:.1f} | {r['first_call_s']:.1f} | "
                f"{r['peak_gib']:.2f} | {r.get('speedup', 1.0):.2f}x | {r.get('memory_ratio', 1.0):.2f}x | {floor} |"
            )
    accuracy = [r for r in rows if r["part"] in ("objective", "accuracy") and r["status"] == "ok"]
    if accuracy:
        lines += ["", "| config | variant vs fp32 | loss rel. error | gradient rel. L2 | worst tensor | its rel. L2 |"]
        lines.append("|---|---|---:|---:|---|---:|")
        for r in accuracy:
            loss_error = f"{r['loss_rel_err']:.2e}" if r.get("loss_rel_err") is not None else ""
            lines.append(
                f"| {r['config']} | {r['impl']} | {loss_error} | {r['grad_rel_l2']:.3e} | {r['worst_tensor']} | "
                f"{r['worst_tensor_rel_l2']:.3e} |"
            )
    return "\n".join(lines) + "\n"


def plot(rows, out_dir, name) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plots")
        return
    timed = [r for r in rows if r["part"] in ("objective", "step") and r["status"] == "ok"]
    if not timed:
        return
    configs = list(dict.fromkeys(r["config"] for r in timed))
    impls = list(dict.fromkeys(r["impl"] for r in timed))
    for metric, label in (("median_ms", "median time (ms)"), ("peak_gib", "peak memory above inputs (GiB)")):
        fig, ax = plt.subplots(figsize=(1.6 * len(configs) + 3, 4))
        width = 0.8 / len(impls)
        for i, impl in enumerate(impls):
            values = [next((r[metric] for r in timed if r["config"] == c and r["impl"] == impl), 0) for c in configs]
            ax.bar([x + i * width for x in range(len(configs))], values, width, label=impl)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(configs))], configs, rotation=15)
        ax.set_ylabel(label)
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, f"{name}_{metric}.png"), dpi=110)
        plt.close(fig)


def _number(text: str):
    try:
        return float(text)
    except ValueError:
        return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("objective", "step", "accuracy", "all"), default="all")
    parser.add_argument("--variants", default=",".join(STEP_VARIANTS), help="also picks the objective's")
    parser.add_argument("--modes", default=",".join(STEP_MODES))
    parser.add_argument("--tiny", action="store_true", help="CPU plumbing check: tiny widths, fp32, interpreter")
    parser.add_argument("--name", default="dspine")
    parser.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "data"))
    parser.add_argument("--budget-s", type=float, default=3600.0)
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--replot", default=None, help="redraw the plots of a CSV this script wrote, and exit")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.replot:
        with open(args.replot, newline="") as handle:
            rows = [{k: _number(v) for k, v in row.items()} for row in csv.DictReader(handle)]
        plot(rows, os.path.dirname(os.path.abspath(args.replot)), os.path.splitext(os.path.basename(args.replot))[0])
        return 0
    if args.tiny:
        os.environ.setdefault("LIGER_DSPINE_INTERPRET", "1")
        args.hidden, args.vocab, args.layers, args.batch, args.seq, args.anchors = 32, 1000, 2, 2, 48, 4
        args.device = "cpu"
    else:
        args.hidden, args.vocab, args.layers, args.batch, args.seq, args.anchors = 4096, 151936, 5, 2, 3072, 512
        args.device = "cuda"
    args.iters = args.iters or (2 if args.tiny else 5)
    if args.child:
        import liger_dspine  # noqa: F401  (the interpreter, from the environment)

        return child(args)

    start = time.monotonic()
    rows = []
    os.makedirs(args.out_dir, exist_ok=True)
    for spec in configurations(args):
        left = args.budget_s - (time.monotonic() - start)
        row = dict(spec, status="skipped")
        if left < 20:
            rows.append(row)
            continue
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
            result_path = handle.name
        command = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec), "--result", result_path]
        command += ["--iters", str(args.iters)] + (["--tiny"] if args.tiny else [])
        began = time.monotonic()
        try:
            completed = subprocess.run(command, timeout=left, capture_output=True, text=True)
            if completed.returncode != 0 or not os.path.getsize(result_path):
                row.update(status="error", error=(completed.stderr.strip().splitlines() or ["?"])[-1][:300])
                print(completed.stderr[-3000:], file=sys.stderr)
            else:
                with open(result_path) as handle:
                    result = json.load(handle)
                for extra in result["rows"]:
                    rows.append(dict(spec, status=result["status"], **extra))
                row = None
        except subprocess.TimeoutExpired:
            row.update(status="timeout")
        finally:
            os.unlink(result_path)
        if row is not None:
            rows.append(row)
        print(f"{spec} done in {time.monotonic() - began:.0f} s", flush=True)
    add_ratios(rows)
    add_run_floor(rows)
    for row in rows:
        row.setdefault("mode", "")
    path = os.path.join(args.out_dir, f"{args.name}.csv")
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    table = markdown(rows)
    with open(os.path.join(args.out_dir, f"{args.name}.md"), "w") as handle:
        handle.write(table)
    plot(rows, args.out_dir, args.name)
    print(table)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
