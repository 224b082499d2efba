"""DSpine's draft-block attention alone: the masked-attention kernel (ops/masked_attention.py) against sdpa.

One layer of the Qwen3-8B-like drafter of the DSpine benchmark: 32 query heads and 8 key-value heads of 128, batch 2,
context 3072, 512 sorted anchors of 16-token blocks (8192 queries over 11264 keys), the causal-block mask of
models/dspine/masks.py, bf16. The implementations, each forward and forward + backward:

- native: what ``DSpineAttention`` runs with sdpa (key-value heads repeated, the mask as a shared additive bias);
- liger-dspine-grouped: the native attention with the grouped heads kept (the previous Liger path);
- liger-dspine: the masked-attention kernel, tile lists made once per mask (timed apart: ``tiles_ms``);
- with ``--baseline FILE``, liger-dspine-baseline: the same from another version of ops/masked_attention.py.

Median of 10 CUDA-event timings after 3 warm-ups, peak memory above the inputs, the fraction of mask tiles the
kernel visits, and rates: the kernel's on the tiles it visits (forward 4 D flops per visited pair and head, backward
2.5x that, as flash attention counts), sdpa's on every pair (its dense rate). Writes benchmark/data/
masked_attention.csv, .md and .png.

``--sweep`` instead times the kernels under each candidate of tile sizes and launch settings (the forward and dq
candidates with the dk / dv kernel fixed, then the dk / dv candidates), checks each against the default settings'
output, and writes masked_attention_sweep.csv / .md.

    python benchmark/bench_masked_attention.py [--anchors 512] [--context 3072] [--baseline FILE] [--sweep]
        [--sweep-groups forward/dq,dk/dv] [--name NAME] [--replot CSV]
"""

import argparse
import csv
import inspect
import itertools
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from baseline_module import load_baseline  # noqa: E402
from cuda_timing import median_ms_and_peak_gib as timed  # noqa: E402

DATA = os.path.join(HERE, "data")
BATCH, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 2, 32, 8, 128, 16
IMPLS = ("native", "liger-dspine-grouped", "liger-dspine")


def visited_pairs(tiles) -> int:
    """[query, key] pairs of the forward's visited tiles, all batches, one head."""
    return int(tiles.key_counts.sum().item()) * tiles.sizes.query * tiles.sizes.key


def rates(forward_ms: float, backward_ms: float, pairs: int) -> tuple[float, float]:
    """(forward, backward) TFLOP/s for ``pairs`` [query, key] pairs per head: 4 D flops each forward, 2.5x back."""
    forward_flops = 4 * HEAD_DIM * HEADS * pairs
    return forward_flops / forward_ms / 1e9, 2.5 * forward_flops / backward_ms / 1e9


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


def measure(anchors: int, context: int, baseline: str | None = None) -> list[dict]:
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
    sizes = masked_attention.tile_sizes(torch.bfloat16, HEAD_DIM, "cuda")
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
    pairs = {"native": BATCH * q.shape[2] * k.shape[2], "liger-dspine-grouped": BATCH * q.shape[2] * k.shape[2]}
    pairs["liger-dspine"] = visited_pairs(tiles)
    if baseline:
        previous = load_baseline(baseline, "baseline_masked_attention")
        # tile_sizes takes the device in versions whose tiles depend on the GPU's shared memory
        takes_device = "device" in inspect.signature(previous.tile_sizes).parameters
        device_args = (q.device,) if takes_device else ()
        previous_tiles = previous.attention_tiles(mask, previous.tile_sizes(torch.bfloat16, HEAD_DIM, *device_args))
        runs["liger-dspine-baseline"] = lambda: previous.liger_masked_attention(
            q, k, v, mask, scale, tiles=previous_tiles
        )
        pairs["liger-dspine-baseline"] = visited_pairs(previous_tiles)
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
        forward_tflops, backward_tflops = rates(forward_ms, step_ms - forward_ms, pairs[impl])
        rows[-1].update(forward_tflops=round(forward_tflops), backward_tflops=round(backward_tflops))
        print(rows[-1], flush=True)
    native = rows[0]["step_ms"]
    for row in rows:
        row["speed_vs_native"] = round(native / row["step_ms"], 2)
    if baseline:  # the baseline's output and gradients against this version's (relative L2, the worst of the four)

        def results(run):
            out = run()
            return (out, *torch.autograd.grad(out, (q, k, v), grads[tuple(out.shape)]))

        ours, theirs = results(runs["liger-dspine"]), results(runs["liger-dspine-baseline"])
        worst = max(float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(ours, theirs))
        print(f"the baseline against this version, relative L2, the worst of out, dq, dk and dv: {worst:.2e}")
    return rows


# The sweep's candidates: forward / dq tiles (query rows, keys per step), dk / dv tiles (keys, query rows per step),
# launch settings (warps, pipeline stages).
SWEEP_QUERY_TILES = ((128, 64), (128, 128), (64, 64), (128, 32))
SWEEP_KEY_TILES = ((64, 64), (128, 64), (128, 32), (64, 32))
SWEEP_LAUNCHES = ((4, 2), (4, 3), (8, 2), (8, 3), (8, 4))
SWEEP_GROUPS = ("forward/dq", "dk/dv")


def sweep_candidates(default) -> list[tuple[str, object]]:
    """(group, TileSizes): the forward / dq candidates keep the default dk / dv settings, and the other way round."""
    from liger_dspine.ops.masked_attention import TileSizes

    fixed = default._asdict()
    candidates = []
    for (query, key), (warps, stages) in itertools.product(SWEEP_QUERY_TILES, SWEEP_LAUNCHES):
        changed = dict(query=query, key=key, forward_warps=warps, forward_stages=stages, dq_warps=warps)
        candidates.append((SWEEP_GROUPS[0], TileSizes(**{**fixed, **changed, "dq_stages": stages})))
    for (dkv_key, dkv_query), (warps, stages) in itertools.product(SWEEP_KEY_TILES, SWEEP_LAUNCHES):
        changed = dict(dkv_key=dkv_key, dkv_query=dkv_query, dkv_warps=warps, dkv_stages=stages)
        candidates.append((SWEEP_GROUPS[1], TileSizes(**{**fixed, **changed})))
    return candidates


def sweep(anchors: int, context: int, groups: tuple[str, ...] = SWEEP_GROUPS) -> list[dict]:
    import torch

    from liger_dspine.ops import masked_attention as ops

    q, k, v, mask = (t.detach() for t in inputs(anchors, context, torch))
    scale = HEAD_DIM**-0.5
    grad_out = torch.randn(BATCH, q.shape[2], HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)

    def run(sizes):
        tiles = ops.attention_tiles(mask, sizes)
        listed = list(sizes)

        def forward():
            return ops._masked_attention(q, k, v, tiles.plane, *tiles[1:5], listed, scale)  # key_tiles .. key_order

        out, lse = forward()
        delta = (grad_out.float() * out.float()).sum(-1).transpose(1, 2).contiguous()

        def backward():
            return ops._masked_attention_backward(
                grad_out, q, k, v, tiles.plane, lse, delta, *tiles[1:9], listed, scale
            )

        return tiles, forward, backward, (out, *backward())

    default = ops.tile_sizes(torch.bfloat16, HEAD_DIM, "cuda")
    _, _, _, reference = run(default)
    rows = []
    for group, sizes in sweep_candidates(default):
        if group not in groups:
            continue
        row = dict(group=group, **sizes._asdict())
        try:
            tiles, forward, backward, results = run(sizes)
            forward_ms, _ = timed(forward, torch)
            backward_ms, _ = timed(backward, torch)
        except Exception as error:  # a setting the GPU cannot take (shared memory, registers)
            row.update(error=f"{type(error).__name__}: {str(error).splitlines()[0][:120]}")
            rows.append(row)
            print(row, flush=True)
            continue
        errors = [((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(results, reference)]
        forward_tflops, backward_tflops = rates(forward_ms, backward_ms, visited_pairs(tiles))
        row.update(
            forward_ms=round(forward_ms, 3),
            backward_ms=round(backward_ms, 3),
            forward_tflops=round(forward_tflops),
            backward_tflops=round(backward_tflops),
            max_relative_error=f"{max(errors):.1e}",
            error="",
        )
        rows.append(row)
        print(row, flush=True)
    return rows


def write_sweep(rows: list[dict], name: str = "masked_attention_sweep") -> None:
    columns = sorted({key for row in rows for key in row}, key=lambda key: list(rows[0]).index(key) if key in rows[0]
                     else len(rows[0]))  # fmt: skip
    os.makedirs(DATA, exist_ok=True)
    with open(os.path.join(DATA, f"{name}.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| group | tiles | warps, stages | fwd ms | bwd ms | fwd TFLOP/s | bwd TFLOP/s | error vs default |",
             "|---|---|---|---:|---:|---:|---:|---|"]  # fmt: skip
    for r in rows:
        forward = r["group"] == "forward/dq"
        tiles = f"{r['query']} x {r['key']}" if forward else f"{r['dkv_key']} x {r['dkv_query']}"
        launch = f"{r['forward_warps']}, {r['forward_stages']}" if forward else f"{r['dkv_warps']}, {r['dkv_stages']}"
        if r.get("error"):
            lines.append(f"| {r['group']} | {tiles} | {launch} | | | | | {r['error']} |")
            continue
        lines.append(
            f"| {r['group']} | {tiles} | {launch} | {r['forward_ms']} | {r['backward_ms']} | {r['forward_tflops']} | "
            f"{r['backward_tflops']} | {r['max_relative_error']} |"
        )
    with open(os.path.join(DATA, f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def write(rows: list[dict], name: str = "masked_attention") -> None:
    os.makedirs(DATA, exist_ok=True)
    with open(os.path.join(DATA, f"{name}.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = [
        "| implementation | fwd ms | bwd ms | fwd+bwd ms | speed | peak GiB | tile lists ms | tiles visited | "
        "fwd TFLOP/s | bwd TFLOP/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['impl']} | {r['forward_ms']} | {r['backward_ms']} | {r['step_ms']} | {r['speed_vs_native']}x | "
            f"{r['peak_gib']} | {r['tiles_ms']} | {r['tiles_visited']} | {r.get('forward_tflops', '')} | "
            f"{r.get('backward_tflops', '')} |"
        )
    lines.append("")
    lines.append(
        "TFLOP/s: sdpa's rows on every [query, key] pair (the dense rate), the kernel's on the pairs of the tiles it "
        "visits."
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
    ax.set_title(f"DSpine attention, {rows[0]['queries']} queries x {rows[0]['keys']} keys, 32/8 heads, bf16")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--anchors", type=int, default=512)
    parser.add_argument("--context", type=int, default=3072)
    parser.add_argument("--baseline", help="another version of ops/masked_attention.py, measured beside this one")
    parser.add_argument("--sweep", action="store_true", help="time the candidate tile sizes and launch settings")
    parser.add_argument(
        "--sweep-groups", default=",".join(SWEEP_GROUPS), help=f"the sweep's kernels: {', '.join(SWEEP_GROUPS)}"
    )
    parser.add_argument("--name", help="the output files' name (default masked_attention, masked_attention_sweep)")
    parser.add_argument("--replot", help="redraw the plot and table from this CSV")
    args, _ = parser.parse_known_args()
    if args.replot:
        with open(args.replot) as f:
            rows = [dict(r) for r in csv.DictReader(f)]
        write(rows)
        return
    if args.sweep:
        groups = tuple(group for group in args.sweep_groups.split(",") if group)
        unknown = set(groups) - set(SWEEP_GROUPS)
        if unknown:
            parser.error(f"--sweep-groups: unknown {sorted(unknown)}; the groups are {', '.join(SWEEP_GROUPS)}")
        write_sweep(sweep(args.anchors, args.context, groups), args.name or "masked_attention_sweep")
        return
    write(measure(args.anchors, args.context, args.baseline), args.name or "masked_attention")


if __name__ == "__main__":
    main()
