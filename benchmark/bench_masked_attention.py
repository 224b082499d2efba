"""DSpine's draft-block attention alone: the masked-attention kernel (ops/masked_attention.py) against sdpa, H200.

One layer of the Qwen3-8B-like drafter of the DSpine benchmark: 32 query heads and 8 key-value heads of 128, batch 2,
context 3072, 512 sorted anchors of 16-token blocks (8192 queries over 11264 keys), the causal-block mask of
models/dspine/masks.py, bf16. Three implementations, each forward and forward + backward:

- native: what ``DSpineAttention`` runs with sdpa (key-value heads repeated, the mask as a shared additive bias);
- liger-dspine-grouped: the native attention with the grouped heads kept (the previous Liger path);
- liger-dspine: the masked-attention kernel, tile lists made once per mask (timed apart: ``tiles_ms``).

Median of 10 CUDA-event timings after 3 warm-ups, peak memory above the inputs, and the fraction of mask tiles the
kernel visits. Writes benchmark/data/masked_attention.csv, .md and .png.

    python benchmark/bench_masked_attention.py [--anchors 512] [--context 3072] [--replot CSV]
"""

import argparse
import csv
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from cuda_timing import median_ms_and_peak_gib as timed  # noqa: E402

DATA = os.path.join(HERE, "data")
BATCH, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 2, 32, 8, 128, 16
IMPLS = ("native", "liger-dspine-grouped", "liger-dspine")


def inputs(anchors: int, context: int, torch):
    from liger_dspine.models.dspine.masks import causal_block_mask

    generator = torch.Generator(device="cuda").manual_seed(0)
    chosen = torch.stack(
        [torch.randperm(context - 1, device="cuda", generator=generator)[:anchors] + 1 for _ in range(BATCH)]
    )
    keep = torch.ones(BATCH, anchors, dtype=torch.bool, device="cuda")
    mask = causal_block_mask(chosen.sort(dim=1).values, keep, context, BLOCK)
    q_len, k_len = mask.shape[2], mask.shape[3]

    def states(length, heads):  # [B, T, heads, D] storage seen as [B, heads, T, D], as the attention makes them
        x = torch.randn(BATCH, length, heads, HEAD_DIM, device="cuda", generator=generator, dtype=torch.bfloat16)
        return x.transpose(1, 2).requires_grad_()

    return states(q_len, HEADS), states(k_len, KV_HEADS), states(k_len, KV_HEADS), mask


def measure(anchors: int, context: int) -> list[dict]:
    import torch

    from liger_dspine.models.dspine import liger_attention
    from liger_dspine.models.dspine.attention import DSpineAttention
    from liger_dspine.models.dspine.attention import prepare_mask
    from liger_dspine.models.dspine.liger_attention import LigerDSpineAttention
    from liger_dspine.ops import masked_attention

    q, k, v, mask = inputs(anchors, context, torch)
    scale = HEAD_DIM**-0.5
    grads = {
        shape: torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        for shape in ((BATCH, HEADS, q.shape[2], HEAD_DIM), (BATCH, q.shape[2], HEADS, HEAD_DIM))
    }
    prepared = prepare_mask(mask)
    sizes = masked_attention.tile_sizes(torch.bfloat16, HEAD_DIM)
    tiles = prepared.tiles(sizes, BATCH)
    visited = tiles.key_counts.sum().item() / tiles.key_tiles.numel()
    tiles_ms, _ = timed(lambda: masked_attention.attention_tiles(mask, sizes), torch)

    class Config:
        _attn_implementation = "sdpa"

    def module(cls):
        attention = cls.__new__(cls)
        torch.nn.Module.__init__(attention)
        attention.config, attention.scaling, attention.attention_dropout = Config, scale, 0.0
        attention.num_key_value_groups = HEADS // KV_HEADS
        return attention

    def grouped():  # the Liger module where the kernel cannot run: sdpa with the grouped heads kept
        original = liger_attention.masked_attention_runs
        liger_attention.masked_attention_runs = lambda *args: False
        try:
            return module(LigerDSpineAttention)._attend(q, k, v, prepared)
        finally:
            liger_attention.masked_attention_runs = original

    runs = {
        "native": lambda: module(DSpineAttention)._attend(q, k, v, prepared),
        "liger-dspine-grouped": grouped,
        "liger-dspine": lambda: masked_attention.liger_masked_attention(q, k, v, mask, scale, tiles=tiles),
    }
    rows = []
    for impl, run in runs.items():

        def forward():
            with torch.no_grad():
                run()

        def step():
            out = run()  # [B, N, Q, D] from the modules, [B, Q, N, D] from the op
            torch.autograd.grad(out, (q, k, v), grads[tuple(out.shape)])

        forward_ms, _ = timed(forward, torch)
        step_ms, step_gib = timed(step, torch)
        rows.append(
            dict(
                impl=impl,
                queries=q.shape[2],
                keys=k.shape[2],
                tiles_visited=round(visited, 3),
                forward_ms=round(forward_ms, 2),
                backward_ms=round(step_ms - forward_ms, 2),
                step_ms=round(step_ms, 2),
                tiles_ms=round(tiles_ms, 2) if impl == "liger-dspine" else "",
                peak_gib=round(step_gib, 2),
            )  # fmt: skip
        )
        print(rows[-1], flush=True)
    native = rows[0]["step_ms"]
    for row in rows:
        row["speed_vs_native"] = round(native / row["step_ms"], 2)
    return rows


def write(rows: list[dict], name: str = "masked_attention") -> None:
    os.makedirs(DATA, exist_ok=True)
    with open(os.path.join(DATA, f"{name}.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = [
        "| implementation | fwd ms | bwd ms | fwd+bwd ms | speed | peak GiB | tile lists ms | tiles visited |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['impl']} | {r['forward_ms']} | {r['backward_ms']} | {r['step_ms']} | {r['speed_vs_native']}x | "
            f"{r['peak_gib']} | {r['tiles_ms']} | {r['tiles_visited']} |"
        )
    with open(os.path.join(DATA, f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    plot(rows, os.path.join(DATA, f"{name}.png"))
    print("\n".join(lines))


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = range(len(rows))
    forward = [float(r["forward_ms"]) for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(x, forward, 0.5, label="forward")
    ax.bar(x, [float(r["backward_ms"]) for r in rows], 0.5, bottom=forward, label="backward")
    ax.set_xticks(list(x), [r["impl"] for r in rows])
    ax.set_ylabel("ms per layer")
    ax.set_title(f"DSpine attention, {rows[0]['queries']} queries x {rows[0]['keys']} keys, 32/8 heads, H200 bf16")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--anchors", type=int, default=512)
    parser.add_argument("--context", type=int, default=3072)
    parser.add_argument("--replot", help="redraw the plot and table from this CSV")
    args, _ = parser.parse_known_args()
    if args.replot:
        with open(args.replot) as f:
            rows = [dict(r) for r in csv.DictReader(f)]
        write(rows)
        return
    write(measure(args.anchors, args.context))


if __name__ == "__main__":
    main()
