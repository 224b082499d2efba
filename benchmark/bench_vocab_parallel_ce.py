"""Memory and time of the loss on a tensor-parallel lm_head, one rank's share, simulated in one process.

Under a tensor-parallel plan each of the tp ranks holds V / tp rows of lm_head. Per rank:
    logits      transformers' path: the local logits [T, V/tp], gathered to [T, V] on every rank
                ("colwise_gather_output"), then the cross entropy on them (an fp32 upcast, its gradient)
    vocab-par   this package's vocabulary-parallel fused loss: token chunks of the local [T, V/tp] logits, three
                numbers per row all-reduced, no [T, V] tensor on any rank
One process stands for one rank (a one-rank process group: the all-reduces cost nothing here; on NCCL they move
3 x T floats, and d hidden [T, H] in fp32 once). The goal: the fused loss's peak above the inputs is at most
1/tp of the logits path's plus one fused chunk.

    python benchmark/bench_vocab_parallel_ce.py                       # DeepSeek-V3's head, T = 4096 and 16384
    python benchmark/bench_vocab_parallel_ce.py --tiny                # a CPU check of the script (no timing)
Writes data/vocab_parallel_ce.{csv,md,png}.
"""

import argparse
import csv
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

if not torch.cuda.is_available():  # --tiny: Triton's CPU interpreter, switched on before any kernel module
    os.environ.setdefault("LIGER_DSPINE_INTERPRET", "1")
import liger_dspine  # noqa: E402,F401
from liger_dspine.ops.linear_cross_entropy import default_vocab_chunk  # noqa: E402
from liger_dspine.ops.vocab_parallel_cross_entropy import liger_vocab_parallel_linear_cross_entropy  # noqa: E402

GIB = 2**30
IGNORE_INDEX = -100
FIELDS = ["impl", "tp", "tokens", "vocab", "hidden", "dtype", "fwd_bwd_ms", "peak_gib", "chunk_gib", "goal_gib"]
FIELDS += ["loss", "status"]


def one_rank_group(device: str) -> bool:
    """Starts a one-rank process group unless one exists; returns whether it started one."""
    if dist.is_initialized():
        return False
    store = tempfile.mktemp(prefix="vocab_parallel_store")
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    return True


def logits_path(hidden, local_weight, targets, tp: int):
    local = hidden @ local_weight.t()  # [T, V/tp]
    gathered = torch.cat([local] * tp, dim=1)  # stands for the all-gather's [T, V] on every rank
    return F.cross_entropy(gathered.float(), targets, ignore_index=IGNORE_INDEX)


def vocab_parallel(hidden, local_weight, targets, tp: int):
    return liger_vocab_parallel_linear_cross_entropy(
        hidden, local_weight, targets, 0, local_weight.shape[0] * tp, ignore_index=IGNORE_INDEX
    )


IMPLS = {"logits": logits_path, "vocab-par": vocab_parallel}


def measure(impl, tp, tokens, hidden_size, vocab, dtype, device, iters, warmup):
    generator = torch.Generator(device=device).manual_seed(0)
    local_vocab = vocab // tp
    hidden = torch.randn(tokens, hidden_size, generator=generator, device=device, dtype=dtype).requires_grad_()
    weight = torch.randn(local_vocab, hidden_size, generator=generator, device=device, dtype=dtype)
    weight = (weight * hidden_size**-0.5).requires_grad_()
    targets = torch.randint(0, local_vocab, (tokens,), generator=generator, device=device)  # all on this rank's rows
    targets[::16] = IGNORE_INDEX
    fn = IMPLS[impl]

    def step():
        hidden.grad = weight.grad = None
        loss = fn(hidden, weight, targets, tp)
        loss.backward()
        return loss

    cuda = device == "cuda"
    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    for _ in range(iters):
        loss = step()
    if cuda:
        torch.cuda.synchronize()
    ms = (time.perf_counter() - start) * 1e3 / iters
    peak = (torch.cuda.max_memory_allocated() - base) / GIB if cuda else float("nan")
    chunk_gib = tokens * default_vocab_chunk(tokens, local_vocab) * hidden.element_size() / GIB  # one logits chunk
    return {"fwd_bwd_ms": ms if cuda else float("nan"), "peak_gib": peak, "chunk_gib": chunk_gib, "loss": loss.item()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="4096,16384", help="token counts, comma-separated (default 4096,16384)")
    parser.add_argument("--tp", default="1,2,4,8", help="tensor-parallel sizes, comma-separated (default 1,2,4,8)")
    parser.add_argument("--hidden", type=int, default=7168, help="hidden size (default 7168, DeepSeek-V3)")
    parser.add_argument("--vocab", type=int, default=129280, help="vocabulary size (default 129280, DeepSeek-V3)")
    parser.add_argument("--iters", type=int, default=5, help="timed steps (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--tiny", action="store_true", help="CPU, fp32, tiny sizes: checks the script, times nothing")
    parser.add_argument("--budget-s", type=float, default=None, help="stop starting new rows after this many seconds")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "data"), help="output folder")
    args = parser.parse_args(argv)
    if args.tiny:
        device, dtype, tokens, tps, hidden, vocab = "cpu", torch.float32, [24], [1, 2], 8, 40
        args.iters, args.warmup = 1, 0
    else:
        device, dtype, hidden, vocab = "cuda", torch.bfloat16, args.hidden, args.vocab
        tokens, tps = [int(t) for t in args.tokens.split(",")], [int(t) for t in args.tp.split(",")]
    own_group = one_rank_group(device)
    started, rows = time.monotonic(), []
    for t in tokens:
        for tp in tps:
            by_impl = {}
            for impl in IMPLS:
                row = {"impl": impl, "tp": tp, "tokens": t, "vocab": vocab, "hidden": hidden, "dtype": str(dtype)[6:]}
                if args.budget_s and time.monotonic() - started > args.budget_s:
                    rows.append({**row, "status": "skipped: budget"})
                    continue
                try:
                    row.update(measure(impl, tp, t, hidden, vocab, dtype, device, args.iters, args.warmup))
                    row["status"] = "ok"
                except torch.OutOfMemoryError:
                    row["status"] = "out of memory"
                    torch.cuda.empty_cache()
                by_impl[impl] = row
                rows.append(row)
            if "logits" in by_impl and "vocab-par" in by_impl and by_impl["logits"]["status"] == "ok":
                logits_peak = by_impl["logits"]["peak_gib"]
                by_impl["vocab-par"]["goal_gib"] = logits_peak / tp + by_impl["vocab-par"]["chunk_gib"]
    if own_group:
        dist.destroy_process_group()
    write(rows, args.out, tiny=args.tiny)
    return rows


def write(rows, out, tiny=False):
    os.makedirs(out, exist_ok=True)
    name = "vocab_parallel_ce_tiny" if tiny else "vocab_parallel_ce"
    with open(os.path.join(out, f"{name}.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| tokens | tp | logits path peak GiB | vocab-parallel peak GiB | goal GiB | met | ms (logits / vp) |"]
    lines.append("|---:|---:|---:|---:|---:|---|---|")
    for logits, fused in zip(rows[::2], rows[1::2]):
        goal = fused.get("goal_gib")
        met = "yes" if goal is not None and fused.get("peak_gib", float("inf")) <= goal else "no"
        lines.append(
            f"| {logits['tokens']} | {logits['tp']} | {logits.get('peak_gib', float('nan')):.2f} | "
            f"{fused.get('peak_gib', float('nan')):.2f} | {goal if goal is None else f'{goal:.2f}'} | {met} | "
            f"{logits.get('fwd_bwd_ms', float('nan')):.1f} / {fused.get('fwd_bwd_ms', float('nan')):.1f} |"
        )
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    if tiny:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for impl, marker in (("logits", "o"), ("vocab-par", "s")):
        for tokens in sorted({r["tokens"] for r in rows}):
            points = [(r["tp"], r["peak_gib"]) for r in rows if r["impl"] == impl and r["tokens"] == tokens]
            points = [p for p in points if p[1] == p[1]]
            if points:
                ax.plot(*zip(*points), marker=marker, label=f"{impl}, {tokens} tokens")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tensor-parallel size")
    ax.set_ylabel("peak GiB per rank, above inputs")
    ax.set_title("Loss on a vocabulary-sharded lm_head (V=129280, H=7168, bf16)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, f"{name}.png"), dpi=120)


if __name__ == "__main__":
    main()
