"""benchmark/bench_vocab_parallel_ce.py --tiny on CPU: both implementations run, and on one rank (tp=1) they give
the same loss; the CSV and table are written."""

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "benchmark" / "bench_vocab_parallel_ce.py"


def test_tiny_run_writes_its_table_and_agrees_on_one_rank(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_vocab_parallel_ce", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    import torch.distributed as dist

    rows = module.main(["--tiny", "--out", str(tmp_path)])
    assert not dist.is_initialized()  # the script's one-rank group is gone
    assert [(r["impl"], r["tp"], r["status"]) for r in rows] == [
        ("logits", 1, "ok"),
        ("vocab-par", 1, "ok"),
        ("logits", 2, "ok"),
        ("vocab-par", 2, "ok"),
    ]
    assert rows[1]["loss"] == pytest.approx(rows[0]["loss"], rel=1e-5)
    assert (tmp_path / "vocab_parallel_ce_tiny.csv").read_text().startswith("impl,tp,tokens")
    assert "| 24 | 2 |" in (tmp_path / "vocab_parallel_ce_tiny.md").read_text()
