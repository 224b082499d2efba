"""The DSpine refinement loss's candidate scores (ops/candidate_scores.py): launch settings of the forward and the
backward kernel, on the H200.

One objective chunk of the DSpine benchmark: 1920 rows (128 blocks of 15 proposals), K = 16 candidates, at both
widths of the objective benchmark (hidden 4096 / vocabulary 151936 and 7168 / 129280, bf16). Each kernel reads the
K head rows of every row (K x H x 2 bytes a row, 440 MB a chunk at 7168), so the figure of merit is that read's rate.
Candidate ids are drawn two ways: uniformly over the vocabulary (no reuse between rows) and "shared" (the 15 rows of
a block draw from 32 ids, as the top-k candidates of neighbouring proposals overlap). Each setting: median of 20
CUDA-event timings after 3 warm-ups, its result checked against torch. Writes benchmark/data/candidate_scores.csv,
.md and .png; the fastest settings are the ones ``LAUNCH`` in ops/candidate_scores.py should hold.

    python benchmark/bench_candidate_scores.py
"""

import argparse
import csv
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from cuda_timing import median_ms  # noqa: E402

DATA = os.path.join(HERE, "data")
ROWS, TOP_K, BLOCK_ROWS, SHARED_POOL = 1920, 16, 15, 32
WIDTHS = ((4096, 151936), (7168, 129280))
FORWARD = ((256, 4), (128, 4), (256, 8), (512, 4), (512, 8), (1024, 8))
# tiles 0: the whole row in one program
BACKWARD = ((256, 1, 4), (256, 4, 4), (256, 0, 4), (512, 1, 4), (512, 2, 8), (1024, 1, 8), (1024, 0, 8), (128, 8, 4))


def candidate_ids(kind: str, vocab: int, torch, generator):
    if kind == "uniform":
        return torch.randint(0, vocab, (ROWS, TOP_K), device="cuda", generator=generator)
    blocks = ROWS // BLOCK_ROWS
    pools = torch.randint(0, vocab, (blocks, SHARED_POOL), device="cuda", generator=generator)
    picks = torch.rand(blocks, BLOCK_ROWS, SHARED_POOL, device="cuda", generator=generator).argsort(-1)[..., :TOP_K]
    return pools.gather(1, picks.reshape(blocks, -1)).reshape(ROWS, TOP_K)


def measure(torch) -> list[dict]:
    rows = []
    for hidden_size, vocab in WIDTHS:
        rows += _measure_width(hidden_size, vocab, torch)
        torch.cuda.empty_cache()
    return rows


def _measure_width(hidden_size: int, vocab: int, torch) -> list[dict]:
    from liger_dspine.ops import candidate_scores as ops

    rows = []
    generator = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(vocab, hidden_size, device="cuda", generator=generator).bfloat16()
    hidden = torch.randn(ROWS, hidden_size, device="cuda", generator=generator).bfloat16()
    grad_scores = torch.randn(ROWS, TOP_K, device="cuda", generator=generator)
    read_gb = ROWS * TOP_K * hidden_size * 2 / 1e9
    in_use = {
        "forward": "{}/-/{}".format(*ops.LAUNCH["forward"]),
        "backward": "{}/{}/{}".format(*ops.LAUNCH["backward"]),
    }
    for kind in ("uniform", "shared"):
        ids = candidate_ids(kind, vocab, torch, generator)
        gathered = weight[ids].float()
        want_scores = torch.bmm(gathered, hidden.float()[..., None]).squeeze(-1)
        want_grad = torch.bmm(grad_scores[:, None], gathered).squeeze(1)
        del gathered
        scores = torch.empty(ROWS, TOP_K, device="cuda")
        grad = torch.empty(ROWS, hidden_size, device="cuda", dtype=torch.bfloat16)
        for block_h, warps in FORWARD:
            ms = median_ms(lambda: ops.launch_forward(hidden, weight, ids, scores, block_h, warps), torch)
            error = (scores - want_scores).abs().max().item()
            rows.append(_row("forward", hidden_size, kind, f"{block_h}/-/{warps}", ms, read_gb, error, in_use))
        for block_h, tiles, warps in BACKWARD:
            ms = median_ms(lambda: ops.launch_backward(grad_scores, weight, ids, grad, block_h, tiles, warps), torch)
            error = ((grad.float() - want_grad).abs().max() / want_grad.abs().max()).item()
            rows.append(_row("backward", hidden_size, kind, f"{block_h}/{tiles}/{warps}", ms, read_gb, error, in_use))
        print(f"hidden {hidden_size} {kind}: done", flush=True)
    return rows


def _row(kernel, hidden_size, ids, setting, ms, read_gb, error, in_use):
    used = "yes" if in_use[kernel] == setting else ""
    return dict(
        kernel=kernel, hidden=hidden_size, ids=ids, setting=setting, ms=round(ms, 4),
        read_tb_per_s=round(read_gb / ms, 3), max_error=f"{error:.2e}", in_use=used,
    )  # fmt: skip


def write(rows: list[dict], stem: str) -> None:
    os.makedirs(DATA, exist_ok=True)
    with open(stem + ".csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = [
        "| kernel | hidden | ids | BLOCK_H / tiles / warps | ms | head read TB/s | max error | in use |",
        "|---|---:|---|---|---:|---:|---:|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['kernel']} | {row['hidden']} | {row['ids']} | {row['setting']} | {float(row['ms']):.3f} | "
            f"{float(row['read_tb_per_s']):.2f} | {row['max_error']} | {row['in_use']} |"
        )
    with open(stem + ".md", "w") as handle:
        handle.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(rows, stem + ".png")


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(k, h) for k in ("forward", "backward") for h, _ in WIDTHS]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for axis, (kernel, hidden_size) in zip(axes[0], panels):
        chosen = [r for r in rows if r["kernel"] == kernel and int(r["hidden"]) == hidden_size]
        settings = list(dict.fromkeys(r["setting"] for r in chosen))
        for offset, kind in enumerate(("uniform", "shared")):
            values = {r["setting"]: float(r["read_tb_per_s"]) for r in chosen if r["ids"] == kind}
            axis.bar([i + 0.4 * offset for i in range(len(settings))], [values.get(s, 0) for s in settings], 0.4,
                     label=f"{kind} ids")  # fmt: skip
        axis.set_xticks([i + 0.2 for i in range(len(settings))], settings, rotation=45, fontsize=7)
        axis.set_title(f"{kernel}, hidden {hidden_size}")
        axis.set_ylabel("head rows read, TB/s")
        axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replot", help="redraw the plot and table of a CSV")
    parser.add_argument("--name", default="candidate_scores")
    parser.add_argument("--budget-s", type=float, default=None, help="unused (the run takes under a minute)")
    args = parser.parse_args()
    stem = os.path.join(DATA, args.name)
    if args.replot:
        with open(args.replot) as handle:
            write(list(csv.DictReader(handle)), stem)
        return
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench_candidate_scores.py needs a CUDA device")
    write(measure(torch), stem)


if __name__ == "__main__":
    main()
