"""Benchmark result rows: the CSV layout, reading and writing, and markdown tables with liger-dspine's ratios.

Usage: python benchmark/report.py benchmark/data/part1.csv benchmark/data/part2.csv
"""

import argparse
import csv
import math
import sys

FIELDS = [
    "impl",
    "layers",
    "seq",
    "params",
    "peak_gib",
    "tokens_per_s",
    "step_ms",
    "first_step_s",
    "mfu",
    "status",
    "kind",
    "options",
    "model_tflops",
    "flops_per_step",
    "loss",
    "build_s",
    "attn",
    "experts",
    "moe_autotune",
    "device",
    "model",
]
BASELINES = ("hf", "liger")
# Section 1 of the anchors (H200, 2026-12-02): (layers, seq) -> (HF peak GiB, liger peak GiB, HF tok/s, liger tok/s)
ANCHORS = {
    (2, 4096): (17.30, 13.19, 40339, 36844),
    (2, 8192): (28.26, 16.69, 36617, 37084),
    (2, 16384): (50.18, 23.69, 31374, 32551),
    (2, 32768): (94.01, 37.69, 24365, 25326),
    (8, 4096): (39.13, 34.13, 14902, 14467),
}


def write_rows(path: str, rows: list[dict]) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=FIELDS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({key: _cell(row.get(key)) for key in FIELDS})


def write_csv_and_markdown(stem: str, fields: list[str], rows: list[dict], lines: list[str]) -> None:
    """``stem``.csv (``rows`` under ``fields``) and ``stem``.md (``lines``, a markdown table), which is also printed:
    the files of a benchmark whose rows are not the training step's."""
    with open(stem + ".csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    with open(stem + ".md", "w") as handle:
        handle.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def read_rows(paths: list[str]) -> list[dict]:
    rows = []
    for path in paths:
        with open(path, newline="") as handle:
            rows.extend(_parse(row) for row in csv.DictReader(handle))
    return rows


def _cell(value):
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return value


def _parse(row: dict) -> dict:
    parsed = {}
    for key, value in row.items():
        if key in ("layers", "seq", "params") and value not in ("", None):
            parsed[key] = int(float(value))
        elif key in ("peak_gib", "tokens_per_s", "step_ms", "first_step_s", "mfu", "model_tflops", "loss"):
            parsed[key] = float(value) if value not in ("", None) else None
        else:
            parsed[key] = value
    return parsed


def _fmt(value, digits: int = 2, thousands: bool = False) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if thousands:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


def _ratio(numerator, denominator) -> str:
    if not numerator or not denominator:
        return "-"
    return f"{numerator / denominator:.2f}x"


def throughput_table(rows: list[dict]) -> str:
    """Peak memory and tokens/s per shape and implementation, with each other implementation over hf and liger."""
    ok = [r for r in rows if r.get("kind") == "throughput" and r.get("status") == "ok"]
    impls = _ordered_impls(r["impl"] for r in rows if r.get("kind") == "throughput")
    shapes = sorted({(r["layers"], r["seq"]) for r in rows if r.get("kind") == "throughput"})
    if not shapes:
        return ""
    index = {(r["impl"], r["layers"], r["seq"]): r for r in ok}
    others = [i for i in impls if i not in BASELINES]
    header = ["layers", "seq", "params"]
    header += [f"{i} peak GiB" for i in impls] + [f"{i} tok/s" for i in impls]
    for other in others:
        header += [f"{other}/{b} speed" for b in BASELINES if b in impls]
        header += [f"{other}/{b} peak" for b in BASELINES if b in impls]
        header += [f"{other} MFU", f"{other} first step s"]
    lines = _header_lines(header)
    for layers, seq in shapes:
        found = [index.get((i, layers, seq)) for i in impls]
        params = next((r["params"] for r in found if r), None)
        cells = [str(layers), str(seq), _params(params)]
        cells += [_fmt(r["peak_gib"]) if r else _status(rows, i, layers, seq) for i, r in zip(impls, found)]
        cells += [
            _fmt(r["tokens_per_s"], thousands=True) if r else _status(rows, i, layers, seq)
            for i, r in zip(impls, found)
        ]
        for other in others:
            mine = index.get((other, layers, seq))
            base = [index.get((b, layers, seq)) for b in BASELINES if b in impls]
            cells += [_ratio(mine and mine["tokens_per_s"], b and b["tokens_per_s"]) for b in base]
            cells += [_ratio(mine and mine["peak_gib"], b and b["peak_gib"]) for b in base]
            cells += [
                f"{mine['mfu'] * 100:.1f}%" if mine and mine["mfu"] is not None else "-",
                _fmt(mine["first_step_s"], 1) if mine else "-",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def max_seq_table(rows: list[dict]) -> str:
    """The longest sequence that trained per implementation, and where it stopped."""
    sweep = [r for r in rows if r.get("kind") == "max_seq"]
    if not sweep:
        return ""
    lines = _header_lines(["impl", "longest ok seq", "vs liger", "peak GiB there", "tok/s there", "stopped at", "why"])
    longest = {r["impl"]: r["seq"] for r in sorted(sweep, key=lambda r: r["seq"]) if r["status"] == "ok"}
    for impl in _ordered_impls(r["impl"] for r in sweep):
        mine = sorted((r for r in sweep if r["impl"] == impl), key=lambda r: r["seq"])
        ok = [r for r in mine if r["status"] == "ok"]
        stop = next((r for r in mine if r["status"] != "ok"), None)
        best = ok[-1] if ok else None
        lines.append(
            "| "
            + " | ".join(
                [
                    impl,
                    str(best["seq"]) if best else "-",
                    f"{best['seq'] / longest['liger']:.2f}x" if best and longest.get("liger") else "-",
                    _fmt(best["peak_gib"]) if best else "-",
                    _fmt(best["tokens_per_s"], thousands=True) if best else "-",
                    str(stop["seq"]) if stop else "-",
                    stop["status"] if stop else "sweep end",
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def anchor_table(rows: list[dict]) -> str:
    """hf and liger as measured now next to the anchors' numbers: is this machine the anchors' machine?"""
    ok = {(r["impl"], r["layers"], r["seq"]): r for r in rows if r.get("kind") == "throughput" and r["status"] == "ok"}
    shapes = [s for s in ANCHORS if any((b, *s) in ok for b in BASELINES)]
    if not shapes:
        return ""
    lines = _header_lines(["layers", "seq"] + [f"{b} {what}" for b in BASELINES for what in ("tok/s", "peak GiB")])
    for layers, seq in shapes:
        hf_peak, liger_peak, hf_speed, liger_speed = ANCHORS[(layers, seq)]
        cells = [str(layers), str(seq)]
        for impl, speed, peak in (("hf", hf_speed, hf_peak), ("liger", liger_speed, liger_peak)):
            row = ok.get((impl, layers, seq))
            cells.append(f"{_fmt(row['tokens_per_s'], thousands=True)} ({speed:,})" if row else f"- ({speed:,})")
            cells.append(f"{_fmt(row['peak_gib'])} ({peak:.2f})" if row else f"- ({peak:.2f})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown_report(rows: list[dict]) -> str:
    parts = []
    matmul = [r for r in rows if r.get("kind") == "matmul" and r.get("status") == "ok"]
    if matmul:
        parts.append(f"Measured matrix rate (MFU denominator): {matmul[-1]['model_tflops']:.1f} TFLOP/s")
    for title, table in (
        ("Training step (batch 1): peak memory, tokens/s, ratios", throughput_table(rows)),
        ("Longest sequence, 2 layers, batch 1", max_seq_table(rows)),
        ("Measured now (anchors in parentheses)", anchor_table(rows)),
    ):
        if table:
            parts.append(f"### {title}\n\n{table}")
    failed = [r for r in rows if r.get("status") not in ("ok", None) and r.get("kind") != "max_seq"]
    if failed:
        parts.append(
            "Not ok: " + "; ".join(f"{r['impl']} {r.get('layers')}L/{r.get('seq')}: {r['status']}" for r in failed)
        )
    return "\n\n".join(parts) + "\n"


def _params(count) -> str:
    if not count:
        return "-"
    return f"{count / 1e9:.2f} B" if count >= 1e8 else f"{count:,}"


def _status(rows, impl, layers, seq) -> str:
    for row in rows:
        if (row["impl"], row.get("layers"), row.get("seq")) == (impl, layers, seq) and row.get("kind") == "throughput":
            return row["status"].split(":")[0]
    return "-"


def _ordered_impls(names) -> list[str]:
    names = set(names)
    return [n for n in BASELINES if n in names] + sorted(names - set(BASELINES))


def _header_lines(header: list[str]) -> list[str]:
    align = ["---"] * 1 + ["---:"] * (len(header) - 1)
    return ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Print the markdown tables of benchmark CSV files.")
    parser.add_argument("csv", nargs="+")
    args = parser.parse_args(argv)
    print(markdown_report(read_rows(args.csv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
