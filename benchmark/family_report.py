"""The DeepSeek-family benchmark's markdown table and plot: per model and length, each implementation's tokens/s,
peak memory and first step, liger-dspine's ratios to hf and liger, its loss against hf's, and the goals.

Usage: python benchmark/family_report.py benchmark/data/family.csv [--plot benchmark/data/family.png]
"""

import argparse
import sys

from family_configs import FAMILY
from report import _fmt
from report import _header_lines
from report import _ratio
from report import read_rows

IMPLS = ("hf", "liger", "liger-dspine")
# Goals: liger-dspine at >= 1.15x native tokens/s; <= 0.9x liger-kernel's peak at the longer length; first step <= 15 s
SPEED_GOAL, PEAK_GOAL, FIRST_STEP_GOAL_S = 1.15, 0.9, 15.0
# DeepSeek-V4's own: >= 1.5x native tokens/s (at 4096), <= 0.7x liger-kernel's peak at the longest common length
MODEL_GOALS = {"deepseek_v4": (1.5, 0.7)}
# ... and a longest sequence (batch 1) at least this many times liger-kernel's
LONGEST_GOALS = {"deepseek_v4": 2.0}
# --variant rows (liger-dspine with other options): tokens/s at least this many times the defaults' (FP8: >= 1.25x)
VARIANT_GOALS = {"fp8": 1.25}


def family_markdown(rows: list[dict]) -> str:
    steps = [r for r in rows if r.get("kind") == "throughput"]
    header = ["model", "seq"] + [f"{i} tok/s" for i in IMPLS] + ["liger-dspine/hf speed", "liger-dspine/liger speed"]
    header += [f"{i} peak GiB" for i in IMPLS] + ["liger-dspine/hf peak", "liger-dspine/liger peak"]
    header += [f"{i} first step s" for i in IMPLS] + ["loss liger-dspine - hf"]
    lines = _header_lines(header)
    notes = []
    for model in [m for m in FAMILY if any(r.get("model") == m for r in steps)]:
        mine = [r for r in steps if r.get("model") == model]
        skipped = [r for r in mine if r.get("impl") == "-"]
        if skipped:
            notes.append(f"{model}: {skipped[0]['status']}")
            continue
        for seq in sorted({r["seq"] for r in mine}):
            by_impl = {r["impl"]: r for r in mine if r["seq"] == seq}
            ok = {i: r for i, r in by_impl.items() if r.get("status") == "ok"}
            hf, liger, dspine = (ok.get(i) for i in IMPLS)
            cells = [f"{model} ({FAMILY[model][0]})", str(seq)]
            cells += [_value(by_impl.get(i), "tokens_per_s", thousands=True) for i in IMPLS]
            cells += [_ratio(dspine and dspine["tokens_per_s"], b and b["tokens_per_s"]) for b in (hf, liger)]
            cells += [_value(by_impl.get(i), "peak_gib") for i in IMPLS]
            cells += [_ratio(dspine and dspine["peak_gib"], b and b["peak_gib"]) for b in (hf, liger)]
            cells += [_value(by_impl.get(i), "first_step_s", digits=1) for i in IMPLS]
            cells.append(f"{dspine['loss'] - hf['loss']:+.2e}" if dspine and hf and _has(dspine, hf) else "-")
            lines.append("| " + " | ".join(cells) + " |")
        notes.append(f"{model} goals: {_goals(mine)}")
    failed = [r for r in steps if r.get("impl") != "-" and r.get("status") not in ("ok", None)]
    notes += [f"{r['model']} {r['impl']} {r['seq']}: {r['status']}" for r in failed]
    table = "\n".join(lines) if len(lines) > 2 else ""
    parts = (table, "\n".join(f"- {n}" for n in notes), variant_markdown(steps), sweep_markdown(rows))
    return "\n\n".join(part for part in parts if part) + "\n"


def variant_markdown(steps: list[dict]) -> str:
    """The --variant rows (liger-dspine with other options) beside the liger-dspine defaults' row of the same model
    and length: tokens/s, peak memory and loss, their ratios, and the variant's goal where it has one."""
    variants = [r for r in steps if r.get("impl") not in (*IMPLS, "-")]
    header = ["model", "seq", "variant", "tok/s", "defaults tok/s", "speed vs defaults", "peak GiB"]
    header += ["defaults peak GiB", "peak vs defaults", "loss - defaults", "goal"]
    lines = _header_lines(header)
    for row in sorted(variants, key=lambda r: (list(FAMILY).index(r["model"]), r["seq"], r["impl"])):
        base = next((r for r in steps if r.get("impl") == "liger-dspine" and r.get("model") == row["model"]
                     and r["seq"] == row["seq"] and r.get("status") == "ok"), None)  # fmt: skip
        ok = row.get("status") == "ok"
        cells = [f"{row['model']} ({FAMILY[row['model']][0]})", str(row["seq"]), row["impl"]]
        cells += [_value(row, "tokens_per_s", thousands=True), _value(base, "tokens_per_s", thousands=True)]
        cells.append(_ratio(ok and row["tokens_per_s"], base and base["tokens_per_s"]))
        cells += [_value(row, "peak_gib"), _value(base, "peak_gib")]
        cells.append(_ratio(ok and row["peak_gib"], base and base["peak_gib"]))
        cells.append(f"{row['loss'] - base['loss']:+.2e}" if ok and base and _has(row, base) else "-")
        goal = VARIANT_GOALS.get(row["impl"])
        met = ok and base and row["tokens_per_s"] >= goal * base["tokens_per_s"] if goal else None
        cells.append(f">= {goal}x: {_yes(bool(met))}" if goal else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) if variants else ""


def sweep_markdown(rows: list[dict]) -> str:
    """The longest-sequence sweeps: per model and implementation the longest length that ran at batch 1, the
    shortest that ran out of memory, the peak and step time at the longest; the goals on both."""
    sweeps = [r for r in rows if r.get("kind") == "max_seq" and r.get("impl") != "-"]
    header = ["model", "impl", "longest seq", "first OOM", "peak GiB at longest", "step s at longest", "vs liger"]
    lines = _header_lines(header)
    notes = []
    for model in [m for m in FAMILY if any(r.get("model") == m for r in sweeps)]:
        mine = [r for r in sweeps if r.get("model") == model]
        longest = {i: _longest(mine, i) for i in IMPLS}
        for impl in [i for i in IMPLS if any(r["impl"] == i for r in mine)]:
            best = longest[impl]
            ooms = [r["seq"] for r in mine if r["impl"] == impl and r.get("status") == "oom"]
            failed = [r["status"] for r in mine if r["impl"] == impl and r.get("status") not in ("ok", "oom")]
            cells = [f"{model} ({FAMILY[model][0]})", impl, str(best["seq"]) if best else "-"]
            cells.append(str(min(ooms)) if ooms else "ended: " + failed[0].split(":")[0] if failed else "not reached")
            notes += [f"{model} {impl} sweep: {status}" for status in failed]
            cells += [_fmt(best and best.get("peak_gib")), _fmt(best and best.get("step_ms") / 1e3, 2)]
            cells.append(_ratio(best and best["seq"], longest["liger"] and longest["liger"]["seq"]))
            lines.append("| " + " | ".join(cells) + " |")
        notes.append(f"{model} longest sequence: {_sweep_goals(model, longest)}")
    if len(lines) == 2:
        return ""
    return "\n".join(lines) + "\n\n" + "\n".join(f"- {n}" for n in notes)


def _longest(rows: list[dict], impl: str) -> dict | None:
    ran = [r for r in rows if r["impl"] == impl and r.get("status") == "ok"]
    return max(ran, key=lambda r: r["seq"]) if ran else None


def _sweep_goals(model: str, longest: dict) -> str:
    dspine, liger = longest["liger-dspine"], longest["liger"]
    if not dspine or not liger:
        return "no liger-dspine or liger sweep"
    parts = []
    goal = LONGEST_GOALS.get(model)
    ratio = dspine["seq"] / liger["seq"]
    if goal:
        parts.append(f">= {goal}x liger's: {_yes(ratio >= goal)} ({ratio:.2f}x)")
    else:
        parts.append(f"{ratio:.2f}x liger's")
    return "; ".join(parts)


def _goals(rows: list[dict]) -> str:
    ok = {(r["impl"], r["seq"]): r for r in rows if r.get("status") == "ok"}
    dspine = {seq: r for (impl, seq), r in ok.items() if impl == "liger-dspine"}
    if not dspine:
        return "no liger-dspine row"
    speed_goal, peak_goal = MODEL_GOALS.get(rows[0].get("model"), (SPEED_GOAL, PEAK_GOAL))
    speeds = [r["tokens_per_s"] / ok[("hf", s)]["tokens_per_s"] for s, r in dspine.items() if ("hf", s) in ok]
    parts = [f"speed >= {speed_goal}x hf: " + (_yes(min(speeds) >= speed_goal) if speeds else "no hf row")]
    longest = max([seq for seq in dspine if ("liger", seq) in ok], default=None)  # the longest both ran
    liger = ok.get(("liger", longest))
    if liger and dspine[longest]["peak_gib"] and liger["peak_gib"]:
        ratio = dspine[longest]["peak_gib"] / liger["peak_gib"]
        parts.append(f"peak <= {peak_goal}x liger at {longest}: {_yes(ratio <= peak_goal)} ({ratio:.2f}x)")
    first = max(r["first_step_s"] for r in dspine.values())
    parts.append(f"first step <= {FIRST_STEP_GOAL_S:.0f} s: {_yes(first <= FIRST_STEP_GOAL_S)} ({first:.1f} s)")
    return "; ".join(parts)


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def _has(*rows) -> bool:
    return all(r.get("loss") is not None for r in rows)


def _value(row, key: str, digits: int = 2, thousands: bool = False) -> str:
    if row is None:
        return "-"
    if row.get("status") != "ok":
        return row["status"].split(":")[0]
    return _fmt(row.get(key), digits, thousands)


def family_plot(rows: list[dict], path: str) -> str | None:
    """Grouped bars per (model, length): tokens/s and peak memory per implementation."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = {(r["model"], r["seq"], r["impl"]): r for r in rows if r.get("kind") == "throughput" and r["status"] == "ok"}
    groups = sorted({(m, s) for m, s, _ in ok}, key=lambda g: (list(FAMILY).index(g[0]), g[1]))
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(IMPLS)
    colors = {"hf": "tab:gray", "liger": "tab:blue", "liger-dspine": "tab:red"}
    for ax, (key, label) in zip(axes, (("tokens_per_s", "tokens / s"), ("peak_gib", "peak memory (GiB)"))):
        for n, impl in enumerate(IMPLS):
            xs = [g + (n - 1) * width for g, (m, s) in enumerate(groups) if (m, s, impl) in ok]
            ys = [ok[(m, s, impl)][key] or 0 for m, s in groups if (m, s, impl) in ok]
            ax.bar(xs, ys, width, label=impl, color=colors[impl])
        ax.set_xticks(range(len(groups)), [f"{FAMILY[m][0]}\n{s} tokens" for m, s in groups], fontsize=7)
        ax.set_ylabel(label)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    figure.suptitle("DeepSeek family at real widths (2 layers; V4 3): training step (batch 1)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", nargs="+")
    parser.add_argument("--plot", help="also write the plot to this PNG path")
    args = parser.parse_args(argv)
    rows = read_rows(args.csv)
    print(family_markdown(rows))
    if args.plot:
        print(family_plot(rows, args.plot) or "matplotlib is missing")
    return 0


if __name__ == "__main__":
    sys.exit(main())
