"""Table and loss curves of benchmark/run_multi_gpu.sh's runs: for each engine, native against liger-dspine.

    python benchmark/multi_gpu_report.py FOLDER [--no-plot]
Reads FOLDER/<engine>_<impl>.json; writes FOLDER/multi_gpu.csv, multi_gpu.md and (unless --no-plot) multi_gpu.png.
"""

import argparse
import csv
import glob
import json
import os


def load(folder: str) -> dict:
    runs = {}
    for path in sorted(glob.glob(os.path.join(folder, "*_*.json"))):
        with open(path) as f:
            run = json.load(f)
        runs[(run["engine"], run["impl"])] = run
    return runs


def rows_of(runs: dict) -> list[dict]:
    rows = []
    for engine in sorted({engine for engine, _ in runs}):
        native, patched = runs.get((engine, "native")), runs.get((engine, "liger-dspine"))
        if native is None or patched is None:
            continue
        speed = None
        if native["tokens_per_s"] and patched["tokens_per_s"]:
            speed = patched["tokens_per_s"] / native["tokens_per_s"]
        rows.append(
            {
                "engine": engine,
                "ranks": native["ranks"],
                "native_tok_s": native["tokens_per_s"],
                "liger_tok_s": patched["tokens_per_s"],
                "speedup": speed,
                "native_peak_gib": max(native["peak_gib_per_rank"]),
                "liger_peak_gib": max(patched["peak_gib_per_rank"]),
                "final_loss_native": native["losses"][-1],
                "final_loss_liger": patched["losses"][-1],
                "final_loss_rel_diff": abs(patched["losses"][-1] - native["losses"][-1]) / abs(native["losses"][-1]),
            }
        )
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="the folder of run_multi_gpu.sh's JSON files")
    parser.add_argument("--no-plot", action="store_true", help="write the CSV and table only")
    args = parser.parse_args(argv)
    runs = load(args.folder)
    rows = rows_of(runs)
    if not rows:
        raise SystemExit(f"multi_gpu_report: no pair of native and liger-dspine runs in {args.folder}")
    with open(os.path.join(args.folder, "multi_gpu.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)

    def show(value, form):
        return "-" if value is None or value != value else format(value, form)

    lines = [
        "| engine | ranks | native tok/s | liger-dspine tok/s | speed-up | peak GiB / rank (native / liger-dspine) | "
        "final loss rel. diff |",
        "|---|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['engine']} | {r['ranks']} | {show(r['native_tok_s'], ',.0f')} | {show(r['liger_tok_s'], ',.0f')} | "
            f"{show(r['speedup'], '.2f')} | {show(r['native_peak_gib'], '.2f')} / {show(r['liger_peak_gib'], '.2f')} "
            f"| {r['final_loss_rel_diff']:.2e} |"
        )
    with open(os.path.join(args.folder, "multi_gpu.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    if args.no_plot:
        return rows
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = [r["engine"] for r in rows]
    fig, axes = plt.subplots(1, len(engines), figsize=(3.2 * len(engines), 3), squeeze=False)
    for ax, engine in zip(axes[0], engines):
        for impl, style in (("native", "-"), ("liger-dspine", "--")):
            ax.plot(runs[(engine, impl)]["losses"], style, label=impl)
        ax.set_title(engine)
        ax.set_xlabel("step")
    axes[0][0].set_ylabel("loss")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(args.folder, "multi_gpu.png"), dpi=110)
    return rows


if __name__ == "__main__":
    main()
