"""The fused DSpine objective's per-chunk logit kernels (ops/frozen_head_kernels.py, ops/frozen_head_candidates.py),
on one chunk of the objective benchmark, on the GPU.

At both widths of ``bench_dspine.py --part objective`` (hidden 4096 / vocabulary 151936 and 7168 / 129280, bf16),
one chunk of the fused loss (its rows from ``loss_chunk_rows``, as the op picks them) holds draft and teacher logits
[2C, V] of std about 2. Timed, median of 20 CUDA-event timings after 3 warm-ups:

- the stats kernel (two passes over z and y) and the gradient kernel (one pass over z and y, writing dz) at several
  launch settings (columns per step / warps); the figure of merit is their HBM traffic's rate. Each setting's
  results are checked against the setting in use.
- the top-k candidates: the kernel against torch's top-k over the same sub-blocks, side by side, same ids checked.
- the loss path's chunk: the stats kernel making the candidates and dz itself, at several launch settings, against
  the stats, top-k and gradient kernels launched apart (its dz checked against theirs).

Writes benchmark/data/frozen_head_kernels.csv, .md and .png.

    python benchmark/bench_frozen_head_kernels.py
"""

import argparse
import csv
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from cuda_timing import median_ms  # noqa: E402
from report import write_csv_and_markdown  # noqa: E402

DATA = os.path.join(HERE, "data")
ROWS, TOP_K = 15360, 16  # the objective benchmark's rows (1024 blocks x 15 proposals) and candidates
WIDTHS = ((4096, 151936), (7168, 129280))
SETTINGS = ((2048, 4), (2048, 8), (4096, 4), (4096, 8), (4096, 16), (8192, 8), (8192, 16))
# the one-kernel chunk: (columns per step, warps, register cap or None); at 4096 / 8 the kernel takes 176 registers a
# thread (one program an SM), capped at 128 two programs fit
FUSED_SETTINGS = ((2048, 4, None), (2048, 8, None), (4096, 4, None), (4096, 8, None), (4096, 8, 128), (4096, 16, None),
                  (8192, 16, None))  # fmt: skip


def measure(torch) -> list[dict]:
    return [row for hidden, vocab in WIDTHS for row in _measure_width(hidden, vocab, torch)]


def _measure_width(hidden: int, vocab: int, torch) -> list[dict]:
    torch.cuda.empty_cache()  # the previous width's chunk
    from liger_dspine.ops import frozen_head_kernels as ops
    from liger_dspine.ops.frozen_head_loss import DEFAULT_CHUNK_BYTES
    from liger_dspine.ops.frozen_head_loss import loss_chunk_rows

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    chunk = loss_chunk_rows(ROWS, vocab, 2, True, DEFAULT_CHUNK_BYTES, hidden, sms)
    generator = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(2 * chunk, vocab, device="cuda", generator=generator) * 2).bfloat16()
    z, y = logits[:chunk], logits[chunk:]
    labels = torch.randint(0, vocab, (chunk,), device="cuda", generator=generator)
    ce_scale, l1_scale = (torch.rand(chunk, device="cuda", generator=generator) for _ in range(2))
    plane_gb = chunk * vocab * 2 / 1e9  # one [C, V] bf16 tensor
    in_use = f"{ops._block_v(vocab)}/{ops.STATS_WARPS}"
    grad_in_use = f"{ops._block_v(vocab)}/{ops.GRAD_WARPS}"
    base = dict(hidden=hidden, vocab=vocab, chunk_rows=chunk)
    rows = []

    reference = ops.chunk_stats(z, y, labels)
    for block_v, warps in SETTINGS:
        setting = f"{block_v}/{warps}"
        ms = median_ms(lambda: ops.chunk_stats(z, y, labels, block_v, warps), torch)
        stats = ops.chunk_stats(z, y, labels, block_v, warps)
        error = max(
            (getattr(stats, name) - getattr(reference, name)).abs().max().item()
            for name in ("ce", "l1", "draft_lse", "teacher_lse", "sign_mass", "sub_max")
        )
        rows.append(_row(base, "stats", setting, in_use, ms, 4 * plane_gb, error))

    def grads(block_v, warps, target):
        ops.write_logit_grads(
            target, y, labels, ce_scale, l1_scale, reference.draft_lse, reference.teacher_lse, reference.sign_mass,
            block_v, warps,
        )  # fmt: skip

    want = z.clone()
    grads(None, ops.GRAD_WARPS, want)
    target = z.clone()
    for block_v, warps in SETTINGS:
        setting = f"{block_v}/{warps}"
        target.copy_(z)
        grads(block_v, warps, target)
        error = (target.float() - want.float()).abs().max().item()
        ms = median_ms(lambda: grads(block_v, warps, target), torch)  # in place: later calls see dz, same traffic
        rows.append(_row(base, "grad", setting, grad_in_use, ms, 3 * plane_gb, error))

    # The loss path: the stats kernel that makes the candidates and dz itself, against the three kernels apart.
    def apart(target):
        stats = ops.chunk_stats(target, y, labels)
        ops.chunk_candidates(target, y, stats, TOP_K)
        ops.write_logit_grads(
            target, y, labels, ce_scale, l1_scale, stats.draft_lse, stats.teacher_lse, stats.sign_mass
        )  # fmt: skip

    def fused(block_v, warps, registers, target):
        ops.chunk_stats(
            target, y, labels, block_v, warps, top_k=TOP_K, grad_scales=(ce_scale, l1_scale), max_registers=registers
        )  # fmt: skip

    target.copy_(z)
    apart(target)
    want.copy_(target)
    rows.append(_row(base, "stats+top-k+grad", "apart", in_use, median_ms(lambda: apart(target), torch),
                     7 * plane_gb, 0.0))  # fmt: skip
    for block_v, warps, registers in FUSED_SETTINGS:
        setting = f"{block_v}/{warps}" + (f" ({registers} registers)" if registers else "")
        target.copy_(z)
        fused(block_v, warps, registers, target)
        error = (target.float() - want.float()).abs().max().item()
        ms = median_ms(lambda: fused(block_v, warps, registers, target), torch)
        rows.append(_row(base, "stats+top-k+grad", setting, in_use, ms, 7 * plane_gb, error))

    kernel = ops.chunk_candidates(z, y, reference, TOP_K)
    eager = ops.torch_candidates(z, y, reference, TOP_K)
    same = torch.equal(z.gather(-1, kernel[0]), z.gather(-1, eager[0]))
    for name, fn in (("kernel", ops.chunk_candidates), ("torch", ops.torch_candidates)):
        ms = median_ms(lambda: fn(z, y, reference, TOP_K), torch)
        rows.append(_row(base, "candidates", name, "kernel", ms, 0.0, 0.0 if same else float("nan")))
    print(f"hidden {hidden}: chunk rows {chunk}, done", flush=True)
    return rows


def _row(base, kernel, setting, in_use, ms, gigabytes, error):
    return dict(
        **base, kernel=kernel, setting=setting, ms=round(ms, 4),
        tb_per_s=round(gigabytes / ms, 3) if gigabytes else "", max_error=f"{error:.2e}",
        in_use="yes" if setting == in_use else "",
    )  # fmt: skip


def write(rows: list[dict], stem: str) -> None:
    os.makedirs(DATA, exist_ok=True)
    lines = [
        "| kernel | hidden | chunk rows | BLOCK_V / warps | ms | HBM TB/s | max diff | in use |",
        "|---|---:|---:|---|---:|---:|---:|---|",
    ]
    for row in rows:
        rate = f"{float(row['tb_per_s']):.2f}" if row["tb_per_s"] != "" else ""
        lines.append(
            f"| {row['kernel']} | {row['hidden']} | {row['chunk_rows']} | {row['setting']} | {float(row['ms']):.3f} | "
            f"{rate} | {row['max_error']} | {row['in_use']} |"
        )
    for hidden, _ in WIDTHS:
        chosen = [r for r in rows if r["kernel"] == "candidates" and int(r["hidden"]) == hidden]
        times = {r["setting"]: float(r["ms"]) for r in chosen}
        if len(times) == 2:
            lines.append(f"\ncandidates at hidden {hidden}: torch / kernel = {times['torch'] / times['kernel']:.2f}x")
        chosen = [r for r in rows if r["kernel"] == "stats+top-k+grad" and int(r["hidden"]) == hidden]
        times = {r["setting"]: float(r["ms"]) for r in chosen}
        if "apart" in times and len(times) > 1:
            best = min((ms, s) for s, ms in times.items() if s != "apart")
            lines.append(
                f"\nstats, top-k and grad at hidden {hidden}: apart {times['apart']:.3f} ms, in one kernel "
                f"{best[0]:.3f} ms ({best[1]}): {times['apart'] / best[0]:.2f}x"
            )
    write_csv_and_markdown(stem, list(rows[0]), rows, lines)
    plot(rows, stem + ".png")


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for axis, kernel in zip(axes, ("stats", "grad", "stats+top-k+grad")):
        chosen = [r for r in rows if r["kernel"] == kernel]
        settings = list(dict.fromkeys(r["setting"] for r in chosen))
        field = "ms" if kernel == "stats+top-k+grad" else "tb_per_s"
        for offset, (hidden, _) in enumerate(WIDTHS):
            values = {r["setting"]: float(r[field]) for r in chosen if int(r["hidden"]) == hidden}
            axis.bar([i + 0.4 * offset for i in range(len(settings))], [values.get(s, 0) for s in settings], 0.4,
                     label=f"hidden {hidden}")  # fmt: skip
        axis.set_xticks([i + 0.2 for i in range(len(settings))], settings, rotation=45, fontsize=7)
        axis.set_title(f"{kernel} (one chunk)")
        axis.set_ylabel("ms" if kernel == "stats+top-k+grad" else "HBM traffic, TB/s")
        axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replot", help="redraw the table and plot from this CSV")
    parser.add_argument("--budget-s", type=float, default=None, help="ignored (run_gpu.sh passes it)")
    args, _ = parser.parse_known_args()
    stem = os.path.join(DATA, "frozen_head_kernels")
    if args.replot:
        with open(args.replot) as handle:
            write(list(csv.DictReader(handle)), stem)
        return
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_frozen_head_kernels.py needs a CUDA GPU")
    write(measure(torch), stem)


if __name__ == "__main__":
    main()
