"""The Triton sum over a token's expert slots against a float64 gather-and-sum."""

import pytest
import torch

from liger_dspine.ops.grouped_experts import sum_slots
from liger_dspine.ops.slot_sum import slot_sum
from liger_dspine.ops.slot_sum import slot_sum_supported

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(tokens, top_k, width, dtype, device=DEVICE, extra_rows=3):
    generator = torch.Generator().manual_seed(tokens * 31 + top_k * 7 + width)
    rows = torch.randn(tokens * top_k + extra_rows, width, generator=generator).to(device, dtype)
    row_of_slot = torch.randperm(tokens * top_k + extra_rows, generator=generator)[: tokens * top_k]
    row_of_slot = row_of_slot.view(tokens, top_k).to(device)
    scale = torch.rand(tokens, top_k, generator=generator).to(device)
    return rows, row_of_slot, scale


def _reference(rows, row_of_slot, scale):
    gathered = rows.double()[row_of_slot]  # [T, K, H]
    if scale is not None:
        gathered = gathered * scale.double()[..., None]
    return gathered.sum(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("scaled", [True, False])
@pytest.mark.parametrize("tokens, top_k, width", [(1, 1, 8), (7, 2, 48), (5, 3, 1500), (3, 8, 32)])
def test_matches_float64_sum(dtype, scaled, tokens, top_k, width):
    rows, row_of_slot, scale = _case(tokens, top_k, width, dtype)
    scale = scale if scaled else None
    out = slot_sum(rows, row_of_slot, scale, dtype)
    assert out.dtype == dtype and out.shape == (tokens, width)
    expected = _reference(rows, row_of_slot, scale)
    # fp32 sums of K terms, then one rounding to the output dtype
    tolerance = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(out.double(), expected, **tolerance)
    # the torch path it replaces gives the same fp32 sums (fp32 rows: same slot order, no rounding in between)
    if dtype == torch.float32:
        torch.testing.assert_close(out, sum_slots(rows, row_of_slot, scale), atol=1e-6, rtol=1e-6)


def test_output_dtype_and_empty():
    rows, row_of_slot, scale = _case(4, 2, 16, torch.float32)
    out = slot_sum(rows, row_of_slot, scale, torch.float16)
    torch.testing.assert_close(out, _reference(rows, row_of_slot, scale).half(), atol=1e-3, rtol=1e-3)
    assert slot_sum(rows, row_of_slot[:0], scale[:0], torch.float32).shape == (0, 16)


def test_supported_conditions():
    rows, _, scale = _case(2, 2, 8, torch.float32)
    assert slot_sum_supported(rows, scale) and slot_sum_supported(rows, None)
    assert not slot_sum_supported(rows.double(), None)
    assert not slot_sum_supported(rows, scale.double())
    assert not slot_sum_supported(rows.t(), None)  # column stride not 1


@pytest.mark.cuda
@pytest.mark.parametrize("scaled", [True, False])
def test_cuda_bf16_matches_float64_sum(scaled):
    rows, row_of_slot, scale = _case(4096, 2, 7168, torch.bfloat16)
    scale = scale if scaled else None
    out = slot_sum(rows, row_of_slot, scale, torch.bfloat16)
    expected = _reference(rows, row_of_slot, scale)
    # one bf16 rounding of an fp32 sum: half an ulp of bf16 (2^-9 relative), plus fp32 noise
    assert ((out.double() - expected).abs() <= 2.0**-8 * expected.abs() + 1e-6).all()
