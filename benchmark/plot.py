"""Plots of benchmark CSV files: peak memory and tokens/s against sequence length, one line per implementation.

Usage: python benchmark/plot.py benchmark/data/part1.csv benchmark/data/part2.csv --out-dir benchmark/data
Writes ``<prefix>peak_memory.png`` and ``<prefix>tokens_per_s.png``. Needs matplotlib.
"""

import argparse
import os
import sys

from report import BASELINES
from report import read_rows

COLORS = {"hf": "tab:gray", "liger": "tab:blue", "liger-dspine": "tab:red"}
METRICS = (("peak_gib", "peak memory (GiB)", "peak_memory"), ("tokens_per_s", "tokens / s", "tokens_per_s"))


def _series(rows: list[dict]) -> dict[tuple[str, int], list[tuple[int, float, float]]]:
    """(impl, layers) -> sorted [(seq, peak_gib, tokens_per_s)] over ok throughput and max-seq rows."""
    series: dict[tuple[str, int], dict[int, tuple[float, float]]] = {}
    for row in rows:
        if row.get("kind") not in ("throughput", "max_seq") or row.get("status") != "ok":
            continue
        points = series.setdefault((row["impl"], row["layers"]), {})
        if row["kind"] == "throughput" or row["seq"] not in points:  # the 3-step mean wins over a single step
            points[row["seq"]] = (row["peak_gib"], row["tokens_per_s"])
    return {key: sorted((seq, *values) for seq, values in points.items()) for key, points in series.items()}


def _out_of_memory(rows: list[dict]) -> dict[int, list[str]]:
    """seq -> the implementations whose first out-of-memory length at 2 layers it is."""
    first: dict[str, int] = {}
    for row in rows:
        if row.get("status") == "oom" and row.get("layers") == 2:
            first[row["impl"]] = min(row["seq"], first.get(row["impl"], row["seq"]))
    by_seq: dict[int, list[str]] = {}
    for impl in _impl_order(first):
        by_seq.setdefault(first[impl], []).append(impl)
    return by_seq


def _impl_order(names) -> list[str]:
    names = set(names)
    return [n for n in (*BASELINES, "liger-dspine") if n in names] + sorted(names - {*BASELINES, "liger-dspine"})


def _tick_label(seq: int) -> str:
    return f"{seq // 1024}k" if seq >= 1024 and seq % 1024 == 0 else str(seq)


def make_plots(rows: list[dict], out_dir: str, prefix: str = "") -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = _series(rows)
    out_of_memory = _out_of_memory(rows)
    order = _impl_order(impl for impl, _ in series)
    # ticks: the throughput shapes, each line's longest sequence and the out-of-memory lengths
    ticks = {r["seq"] for r in rows if r.get("kind") == "throughput" and r.get("status") == "ok"}
    ticks = sorted(ticks | {points[-1][0] for points in series.values()} | set(out_of_memory))
    written = []
    for field, label, name in METRICS:
        figure, axes = plt.subplots(figsize=(8, 4.8))
        for (impl, layers), points in sorted(series.items(), key=lambda item: (item[0][1], order.index(item[0][0]))):
            values = [(seq, peak if field == "peak_gib" else speed) for seq, peak, speed in points]
            values = [(seq, value) for seq, value in values if value is not None]
            if not values:
                continue
            xs, ys = zip(*values)
            style = "-o" if layers == 2 else "--s"
            axes.plot(xs, ys, style, color=COLORS.get(impl, "tab:green"), label=f"{impl}, {layers} layers", ms=4)
        for seq, impls in out_of_memory.items():
            axes.axvline(seq, color="black", linestyle=":", linewidth=1)
            text = f"out of memory at 2 layers: {', '.join(impls)}"
            axes.annotate(
                text, (seq, 0.03), xycoords=("data", "axes fraction"), rotation=90, fontsize=7, ha="right", va="bottom"
            )
        axes.set_xscale("log", base=2)
        if ticks:
            axes.set_xticks(ticks, [_tick_label(seq) for seq in ticks], fontsize=7, rotation=45)
            axes.minorticks_off()
        axes.set_ylim(bottom=0)
        axes.set_xlabel("sequence length (tokens, batch 1)")
        axes.set_ylabel(label)
        axes.set_title(f"DeepSeek-V3 training step (slim, real widths): {label}")
        axes.grid(True, alpha=0.3)
        if axes.get_legend_handles_labels()[0]:
            axes.legend(fontsize=8)
        figure.tight_layout()
        path = os.path.join(out_dir, f"{prefix}{name}.png")
        figure.savefig(path, dpi=120)
        plt.close(figure)
        written.append(path)
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", nargs="+")
    parser.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "data"))
    parser.add_argument("--prefix", default="", help="file name prefix, e.g. 'full_'")
    args = parser.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    for path in make_plots(read_rows(args.csv), args.out_dir, args.prefix):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
