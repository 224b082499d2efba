"""DeepSeek-V4's attention alone (ops/sink_attention.py) against the eager attention it replaces, on the H200.

The three layer kinds of V4-Flash at its widths (64 heads of 512 on one shared key-value head, window 128, bf16):
sliding only, CSA (1024 compressed entries at 4096 tokens, each query seeing 512 of them) and HCA (32 entries).
For each: the kernel's forward, its backward (dq and dkv kernels) and the eager forward + backward (scores, sinks,
softmax in fp32, as transformers computes them), median of 10 CUDA-event timings after 3 warm-ups, and the peak
memory of each. Writes benchmark/data/sink_attention.csv, .md and .png.

    python benchmark/bench_sink_attention.py [--seq 4096] [--replot CSV]
"""

import argparse
import csv
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from cuda_timing import median_ms_and_peak_gib as timed  # noqa: E402

DATA = os.path.join(HERE, "data")
HEADS, HEAD_DIM, WINDOW = 64, 512, 128
KINDS = {"sliding": 0, "csa": 4, "hca": 128}  # compression rate (0: none)
CSA_TOP_K = 512


def inputs(kind: str, seq: int, torch):
    generator = torch.Generator(device="cuda").manual_seed(0)
    rate = KINDS[kind]
    compressed = seq // rate if rate else 0
    q = torch.randn(1, HEADS, seq, HEAD_DIM, device="cuda", generator=generator).bfloat16().requires_grad_()
    kv = torch.randn(1, seq + compressed, HEAD_DIM, device="cuda", generator=generator).bfloat16().requires_grad_()
    sinks = torch.randn(HEADS, device="cuda", generator=generator).requires_grad_()
    positions = torch.arange(seq, device="cuda")
    visible = (positions[None, :] <= positions[:, None]) & (positions[None, :] > positions[:, None] - WINDOW)
    mask = torch.zeros(1, 1, seq, seq, device="cuda", dtype=torch.bfloat16).masked_fill(~visible, float("-inf"))
    bias = None
    if compressed:
        keep = torch.ones(seq, compressed, dtype=torch.bool, device="cuda")
        if kind == "csa":  # each query sees CSA_TOP_K of the entries
            ranks = torch.rand(seq, compressed, device="cuda", generator=generator).argsort(-1).argsort(-1)
            keep = ranks < CSA_TOP_K
        bias = torch.zeros(1, 1, seq, compressed, device="cuda", dtype=torch.bfloat16).masked_fill(~keep, float("-inf"))
    return q, kv, sinks, mask, bias


def eager(q, kv, sinks, mask, bias, scale, torch):
    """transformers' eager attention with sinks: fp32 softmax over [S, S + C + 1] scores."""
    addend = mask if bias is None else torch.cat([mask, bias], dim=-1)
    scores = torch.matmul(q, kv.transpose(-1, -2).unsqueeze(1)) * scale + addend
    scores = torch.cat([scores, sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)], dim=-1)
    probs = torch.softmax(scores.float(), dim=-1)[..., :-1].to(q.dtype)
    return torch.matmul(probs, kv.unsqueeze(1)).transpose(1, 2)


def measure(seq: int) -> list[dict]:
    import torch

    from liger_dspine.ops.sink_attention import liger_sink_attention

    rows = []
    scale = HEAD_DIM**-0.5
    for kind in KINDS:
        q, kv, sinks, mask, bias = inputs(kind, seq, torch)
        grad = torch.randn(1, seq, HEADS, HEAD_DIM, device="cuda").bfloat16()

        def kernel_forward():
            with torch.no_grad():
                liger_sink_attention(q, kv, sinks, WINDOW, scale, mask=mask, bias=bias)

        def kernel_step():
            out = liger_sink_attention(q, kv, sinks, WINDOW, scale, mask=mask, bias=bias)
            torch.autograd.grad(out, (q, kv, sinks), grad)

        def eager_step():
            out = eager(q, kv, sinks, mask, bias, scale, torch)
            torch.autograd.grad(out, (q, kv, sinks), grad)

        forward_ms, _ = timed(kernel_forward, torch)
        step_ms, step_gib = timed(kernel_step, torch)
        eager_ms, eager_gib = timed(eager_step, torch)
        rows.append(
            dict(
                kind=kind,
                seq=seq,
                compressed=kv.shape[1] - seq,
                kernel_forward_ms=round(forward_ms, 2),
                kernel_backward_ms=round(step_ms - forward_ms, 2),
                kernel_step_ms=round(step_ms, 2),
                eager_step_ms=round(eager_ms, 2),
                speedup=round(eager_ms / step_ms, 2),
                kernel_peak_gib=round(step_gib, 2),
                eager_peak_gib=round(eager_gib, 2),
            )  # fmt: skip
        )
        print(rows[-1], flush=True)
    return rows


def write(rows: list[dict], name: str = "sink_attention") -> None:
    os.makedirs(DATA, exist_ok=True)
    with open(os.path.join(DATA, f"{name}.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    header = "| layer | tokens | compressed | kernel fwd ms | kernel bwd ms | kernel fwd+bwd ms | eager fwd+bwd ms | speed | kernel GiB | eager GiB |"  # noqa: E501
    lines = [header, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['kind']} | {r['seq']} | {r['compressed']} | {r['kernel_forward_ms']} | {r['kernel_backward_ms']} | "
            f"{r['kernel_step_ms']} | {r['eager_step_ms']} | {r['speedup']}x | {r['kernel_peak_gib']} | "
            f"{r['eager_peak_gib']} |"
        )
    with open(os.path.join(DATA, f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    plot(rows, os.path.join(DATA, f"{name}.png"))
    print("\n".join(lines))


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [r["kind"] for r in rows]
    x = range(len(kinds))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar([i - 0.2 for i in x], [r["eager_step_ms"] for r in rows], 0.4, label="eager (transformers)")
    ax.bar([i + 0.2 for i in x], [r["kernel_forward_ms"] for r in rows], 0.4, label="kernel forward")
    ax.bar([i + 0.2 for i in x], [r["kernel_backward_ms"] for r in rows], 0.4,
           bottom=[r["kernel_forward_ms"] for r in rows], label="kernel backward")  # fmt: skip
    ax.set_xticks(list(x), [f"{k} ({r['compressed']} entries)" for k, r in zip(kinds, rows)])
    ax.set_ylabel("ms, forward + backward")
    ax.set_title(f"DeepSeek-V4 attention, {rows[0]['seq']} tokens, 64 x 512 heads, H200 bf16")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--replot", help="redraw the plot and table from this CSV")
    args, _ = parser.parse_known_args()
    if args.replot:
        with open(args.replot) as f:
            rows = [dict(r) for r in csv.DictReader(f)]
        write(rows)
        return
    write(measure(args.seq))


if __name__ == "__main__":
    main()
