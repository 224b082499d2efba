"""benchmark/baseline_module.py: another version of an op module loads beside the package's own (its ops under
another namespace) and computes what the package's version computes."""

import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "benchmark"))

from baseline_module import load_baseline  # noqa: E402
from liger_dspine.ops import masked_attention  # noqa: E402


def test_a_second_masked_attention_module_loads_and_agrees():
    source = os.path.join(ROOT, "src", "liger_dspine", "ops", "masked_attention.py")
    other = load_baseline(source, "baseline_masked_attention_under_test")
    assert other._masked_attention.opoverload is not masked_attention._masked_attention.opoverload
    assert other._masked_attention._qualname == "liger_dspine_baseline::masked_attention"
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 40, 16, generator=generator)
    k, v = (torch.randn(1, 1, 50, 16, generator=generator) for _ in range(2))
    mask = torch.rand(1, 1, 40, 50, generator=generator) < 0.5
    torch.testing.assert_close(
        other.liger_masked_attention(q, k, v, mask, 0.25), masked_attention.liger_masked_attention(q, k, v, mask, 0.25)
    )
