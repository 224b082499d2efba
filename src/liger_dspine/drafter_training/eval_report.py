"""The acceptance report of ``eval-drafter``: a table, a JSON and a CSV file, and a PNG plot (with matplotlib)."""

import csv
import json
import os

from liger_dspine.drafter_training.evaluation import AcceptanceStats

NO_MATPLOTLIB = "matplotlib is not installed: no plot (pip install matplotlib)"


def columns(offline: dict, end_to_end: dict | None) -> dict[str, AcceptanceStats]:
    """Column name -> statistics, offline first."""
    result = {f"offline {name}": stats for name, stats in offline.items()}
    for name, stats in (end_to_end or {}).items():
        result[f"end-to-end {name}"] = stats
    return result


def table(report: dict[str, AcceptanceStats]) -> str:
    """Mean acceptance length, blocks (offline) or steps (end to end), then each block position's acceptance rate
    (the fraction of blocks whose accepted prefix reaches it) with its rate given the position before."""
    names = list(report)
    width = max(12, *(len(name) for name in names))
    lines = [f"{'':<26}" + "".join(f"{name:>{width + 2}}" for name in names)]

    def row(label, values):
        lines.append(f"{label:<26}" + "".join(f"{value:>{width + 2}}" for value in values))

    row("mean acceptance length", [f"{stats.mean_acceptance_length:.3f}" for stats in report.values()])
    row("blocks / steps", [str(stats.blocks) for stats in report.values()])
    positions = next(iter(report.values())).block_size - 1
    rates = [stats.position_rates() for stats in report.values()]
    conditional = [stats.conditional_rates() for stats in report.values()]
    for position in range(positions):
        row(
            f"position {position + 1}",
            [f"{r[position]:.3f} ({c[position]:.3f})" for r, c in zip(rates, conditional)],
        )
    lines.append(
        "position j: the fraction of blocks accepting j proposals or more (in brackets: of those accepting j - 1)"
    )
    return "\n".join(lines)


def as_dict(report: dict[str, AcceptanceStats]) -> dict:
    return {
        name: {
            "mean_acceptance_length": stats.mean_acceptance_length,
            "blocks": stats.blocks,
            "position_rates": stats.position_rates(),
            "conditional_rates": stats.conditional_rates(),
        }
        for name, stats in report.items()
    }


def write(report: dict[str, AcceptanceStats], output_dir: str, title: str) -> list[str]:
    """acceptance.json, acceptance.csv (one row per block position) and acceptance.png; returns the lines to print
    (the files written, or that matplotlib is missing)."""
    os.makedirs(output_dir, exist_ok=True)
    written = []
    path = os.path.join(output_dir, "acceptance.json")
    with open(path, "w") as handle:
        json.dump(as_dict(report), handle, indent=2)
    written.append(path)
    path = os.path.join(output_dir, "acceptance.csv")
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["position", *report])
        rates = [stats.position_rates() for stats in report.values()]
        for position in range(len(rates[0])):
            writer.writerow([position + 1, *(f"{r[position]:.6f}" for r in rates)])
    written.append(path)
    plotted = plot(report, os.path.join(output_dir, "acceptance.png"), title)
    return [f"wrote {path}" for path in written] + [f"wrote {plotted}" if plotted else NO_MATPLOTLIB]


def plot(report: dict[str, AcceptanceStats], path: str, title: str) -> str | None:
    """The acceptance rate of each block position, one line per column; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figure, axis = plt.subplots(figsize=(7, 4))
    for name, stats in report.items():
        rates = stats.position_rates()
        style = "-" if name.startswith("offline") else "--"
        label = f"{name} (mean length {stats.mean_acceptance_length:.2f})"
        axis.plot(range(1, len(rates) + 1), rates, style, marker="o", label=label)
    axis.set_xlabel("block position")
    axis.set_ylabel("acceptance rate (prefix reaches the position)")
    axis.set_ylim(0.0, 1.0)
    axis.set_title(title)
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
