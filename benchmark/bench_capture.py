"""Target capture benchmark: ``TargetCapture`` against ``output_hidden_states=True`` on a frozen DeepSeek-V3 target.

The target is DeepSeek-V3 at its real widths (hidden 7168, vocab 129280, MLA, bf16), 2 layers (1 dense, 1 MoE with
16 routed experts, as ``bench_deepseek_v3.py``), one row of 4096 tokens, taps ``[0, 1]``; native and patched by
liger-dspine (class level). Methods, each producing the objective's taps [B, S, T*H] and final states [B, S, H]:
- ``capture``: :class:`~liger_dspine.models.dspine.capture.TargetCapture` (hooks on the taps and the final norm,
  no cache, no head);
- ``hidden_states``: ``target.model(input_ids, output_hidden_states=True)`` with transformers' defaults;
- ``causal_lm_hidden_states``: ``target(input_ids, output_hidden_states=True)``, logits included.

Times: CUDA events, median of the timed calls after a warm-up. Memory: the peak above what was allocated before the
call, with the returned tensors alive. ``max_abs_diff``: against ``hidden_states``'s taps and final states (0 is
bit-identical).

    python benchmark/bench_capture.py                  # H200: CSV, markdown and PNGs under benchmark/data/
    python benchmark/bench_capture.py --tiny           # CPU plumbing check: the tests' tiny DeepSeek-V3, fp32
"""

import argparse
import csv
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
METHODS = ("capture", "hidden_states", "causal_lm_hidden_states")
IMPLS = ("native", "liger-dspine")
FIELDS = [
    "impl", "method", "layers", "seq", "taps", "median_ms", "first_call_s", "peak_gib", "returned_gib", "speedup",
    "memory_ratio", "max_abs_diff",
]  # fmt: skip


def target_config(layers: int, seq: int, tiny: bool):
    sys.path.insert(0, HERE)
    from bench_deepseek_v3 import deepseek_v3_config

    return deepseek_v3_config(layers, tiny, seq)


def method_fn(method: str, target, taps):
    import torch

    from liger_dspine.models.dspine.capture import TargetCapture

    if method == "capture":
        capture = TargetCapture(target, taps)
        return lambda ids: (lambda b: (b["hidden_states"], b["target_last_hidden_states"]))(capture(ids))

    @torch.no_grad()
    def hidden_states(ids):
        module = target.model if method == "hidden_states" else target
        out = module(ids, output_hidden_states=True)
        last = out.hidden_states[-1]  # the final-normed state, as last_hidden_state
        return torch.cat([out.hidden_states[i + 1] for i in taps], dim=-1), last, out

    return hidden_states


def measure(fn, ids, device, iters):
    """(median ms, first call s, peak GiB above the allocation before the call, GiB of what the call returned)."""
    import torch

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    sync()
    start = time.perf_counter()
    result = fn(ids)
    sync()
    first = time.perf_counter() - start
    returned = sum(t.numel() * t.element_size() for t in result[:2]) / 2**30
    del result
    times, peaks = [], []
    for _ in range(iters):
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        sync()
        start = time.perf_counter()
        result = fn(ids)
        sync()
        times.append((time.perf_counter() - start) * 1e3)
        if device == "cuda":
            peaks.append((torch.cuda.max_memory_allocated() - base) / 2**30)
        kept = result[:2]
        del result
    return statistics.median(times), first, max(peaks) if peaks else float("nan"), returned, kept


def run_impl(args, impl: str) -> list[dict]:
    import torch
    from transformers import DeepseekV3ForCausalLM

    if impl == "liger-dspine":
        from liger_dspine import apply_liger_kernel_to_deepseek_v3

        apply_liger_kernel_to_deepseek_v3()
    config = target_config(args.layers, args.seq, args.tiny)
    torch.manual_seed(0)
    with torch.device(args.device):
        target = DeepseekV3ForCausalLM(config).to(args.dtype).eval().requires_grad_(False)
    ids = torch.randint(0, config.vocab_size, (1, args.seq), device=args.device)
    rows, reference = [], None
    for method in ("hidden_states", "capture", "causal_lm_hidden_states"):
        if method not in args.methods:
            continue
        median_ms, first_s, peak, returned, kept = measure(
            method_fn(method, target, args.taps), ids, args.device, args.iters
        )
        if method == "hidden_states":
            reference = kept
        diff = ""
        if reference is not None:
            diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(kept, reference))
        rows.append(
            dict(
                impl=impl,
                method=method,
                layers=args.layers,
                seq=args.seq,
                taps=" ".join(map(str, args.taps)),
                median_ms=median_ms,
                first_call_s=first_s,
                peak_gib=peak,
                returned_gib=returned,
                max_abs_diff=diff,
            )  # fmt: skip
        )
        print(f"{impl:>12} {method:>24}: {median_ms:9.1f} ms, peak {peak:.3f} GiB, max |diff| {diff}", flush=True)
        del kept
    del target
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return rows


def add_ratios(rows):
    for row in rows:
        base = next((r for r in rows if r["impl"] == row["impl"] and r["method"] == "hidden_states"), None)
        if base:
            row["speedup"] = base["median_ms"] / row["median_ms"]
            row["memory_ratio"] = row["peak_gib"] / base["peak_gib"] if base["peak_gib"] == base["peak_gib"] else ""


def markdown(rows) -> str:
    lines = [
        "| target | method | median ms | peak GiB | returned GiB | speed vs hidden_states | memory vs hidden_states |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        memory = f"{r['memory_ratio']:.2f}x" if isinstance(r.get("memory_ratio"), float) else ""
        lines.append(
            f"| {r['impl']} | {r['method']} | {r['median_ms']:.1f} | {r['peak_gib']:.3f} | {r['returned_gib']:.3f} | "
            f"{r.get('speedup', 1.0):.2f}x | {memory} |"
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
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    for metric, label in (("median_ms", "median time (ms)"), ("peak_gib", "peak memory above inputs (GiB)")):
        fig, ax = plt.subplots(figsize=(7, 4))
        width = 0.8 / len(methods)
        for i, method in enumerate(methods):
            values = [
                next((r[metric] for r in rows if r["impl"] == impl and r["method"] == method), 0) for impl in impls
            ]
            ax.bar([x + i * width for x in range(len(impls))], values, width, label=method)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(impls))], impls)
        ax.set_ylabel(label)
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, f"{name}_{metric}.png"), dpi=110)
        plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="CPU plumbing check: tiny DeepSeek-V3, fp32, interpreter")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=None, help="tokens (default 4096; 64 with --tiny)")
    parser.add_argument("--taps", default="0,1")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--name", default="capture")
    parser.add_argument("--out-dir", default=os.path.join(HERE, "data"))
    parser.add_argument("--budget-s", type=float, default=None, help="accepted for run_gpu.sh; the run is short")
    args = parser.parse_args(argv)
    if args.tiny:
        os.environ.setdefault("LIGER_DSPINE_INTERPRET", "1")
    import torch

    import liger_dspine  # noqa: F401  (the interpreter, from the environment)

    args.device = "cpu" if args.tiny else "cuda"
    args.dtype = torch.float32 if args.tiny else torch.bfloat16
    args.seq = args.seq or (64 if args.tiny else 4096)
    args.iters = args.iters or (1 if args.tiny else 5)
    args.taps = [int(t) for t in args.taps.split(",")]
    args.methods = args.methods.split(",")
    rows = []
    for impl in args.impls.split(","):
        rows += run_impl(args, impl)
    add_ratios(rows)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, f"{args.name}.csv"), "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    table = markdown(rows)
    with open(os.path.join(args.out_dir, f"{args.name}.md"), "w") as handle:
        handle.write(table)
    print(table)
    plot(rows, args.out_dir, args.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
