"""The README's results and the demos' GPU lines are read against ``benchmark/RESULTS.md``, so the two cannot
disagree: the DeepSeek-V3 table cell by cell from RESULTS.md's throughput and memory tables, every other number by
value (a README number rounds a RESULTS.md number to the README's digits)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
NUMBER = re.compile(r"(?<![\w.])\d{1,3}(?:,\d{3})+(?:\.\d+)?x?|(?<![\w.])\d+(?:\.\d+)?x?(?![\w.])")


def section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start : end if end > 0 else len(text)]


def table_rows(text: str) -> list[list[str]]:
    rows = [line.strip("|").split("|") for line in text.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row] for row in rows if not set(row[0].strip()) <= set("-:")]


def value(token: str) -> float:
    return float(token.rstrip("x").replace(",", ""))


def digits(token: str) -> int:
    return len(token.rstrip("x").split(".")[1]) if "." in token else 0


def results_numbers() -> list[tuple[str, float]]:
    text = (ROOT / "benchmark" / "RESULTS.md").read_text()
    return [(token, value(token)) for token in NUMBER.findall(text)]


def found_in_results(token: str, numbers) -> bool:
    want, places, ratio = value(token), digits(token), token.endswith("x")
    return any(round(number, places) == want and text.endswith("x") == ratio for text, number in numbers)


def deepseek_v3_tables() -> dict:
    """RESULTS.md's throughput and peak memory tables: {(layers, seq, "tok/s" or "peak GiB"): {column: cell}}."""
    measured = section((ROOT / "benchmark" / "RESULTS.md").read_text(), "### Throughput and peak memory")
    cells = {}
    for table in measured.split("\n\n"):
        rows = table_rows(table)
        if not rows or rows[0][:2] != ["layers", "seq"]:
            continue
        kind = "tok/s" if "hf tok/s" in rows[0] else "peak GiB"
        for row in rows[1:]:
            cells[(int(row[0]), int(row[1].rstrip(" *")), kind)] = dict(zip(rows[0][2:], row[2:]))
    return cells


def test_readme_deepseek_v3_table_is_results_md_cell_for_cell():
    readme = section((ROOT / "README.md").read_text(), "## Results")
    tables = deepseek_v3_tables()
    rows = [row for row in table_rows(readme) if row[0].startswith(("tokens/s", "peak GiB"))]
    checked = 0
    for label, hf, liger, dspine in rows:
        layers, seq = (int(n) for n in re.findall(r"(\d+) (?:layers|tokens)", label))
        if "recompute_attention" in label:
            continue  # the opt-in table's row, checked by value below
        kind = "tok/s" if label.startswith("tokens/s") else "peak GiB"
        measured = tables[(layers, seq, kind)]
        assert hf == measured[f"hf {kind}"] and liger == measured[f"liger {kind}"], label
        mine, ratio = re.fullmatch(r"\*\*([\d,.]+)\*\* \((\d\.\d+x).*\)", dspine).groups()
        assert mine == measured[f"liger-dspine {kind}"], label
        assert ratio in (measured["vs hf"], measured["vs liger"]), label
        checked += 1
    assert checked == 3


def test_every_number_of_the_readme_results_is_in_results_md():
    readme = section((ROOT / "README.md").read_text(), "## Results")
    readme = re.sub(r"liger-kernel \d+\.\d+\.\d+|!\[.*?\]\(.*?\)|\(benchmark/.*?\)", "", readme)  # versions, paths
    numbers = results_numbers()
    tokens = NUMBER.findall(readme)
    assert len(tokens) > 40
    missing = [token for token in tokens if not found_in_results(token, numbers)]
    assert missing == []


def test_the_demos_gpu_figures_are_in_results_md():
    from liger_dspine.demo import GPU_FIGURES as DEEPSEEK_V3
    from liger_dspine.demo_dspine import GPU_FIGURES as DSPINE

    numbers = results_numbers()
    for line in (DEEPSEEK_V3, DSPINE):
        ratios = [token for token in NUMBER.findall(line) if token.endswith("x")]
        assert len(ratios) >= 3
        assert [token for token in ratios if not found_in_results(token, numbers)] == [], line


def test_a_number_that_is_not_in_results_md_is_caught():
    numbers = results_numbers()
    assert found_in_results("46,312", numbers) and found_in_results("1.84x", numbers)
    assert not found_in_results("46,313", numbers) and not found_in_results("2.71x", numbers)
