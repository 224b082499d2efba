"""Grouped-query attention keeping only the key-value heads: against sdpa on repeated heads (CUDA), and the
shared additive mask against sdpa's own bool-mask conversion (CPU)."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from torch.nn.attention import sdpa_kernel

from liger_dspine.models.dspine.attention import PreparedMask
from liger_dspine.models.dspine.attention import prepare_mask
from liger_dspine.ops.grouped_attention import grouped_attention_runs
from liger_dspine.ops.grouped_attention import liger_grouped_attention


def random_mask(batch, q_len, k_len, generator):
    mask = torch.rand(batch, 1, q_len, k_len, generator=generator) < 0.6
    mask[:, :, 0] = False  # a row with no visible key: prepare_mask opens it up
    return mask


def test_additive_mask_equals_sdpa_on_the_bool_mask_and_is_made_once():
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 8, 16, generator=generator)
    k = torch.randn(2, 4, 12, 16, generator=generator)
    v = torch.randn(2, 4, 12, 16, generator=generator)
    prepared = prepare_mask(random_mask(2, 8, 12, generator))
    bias = prepared.additive(torch.float32)
    assert prepared.additive(torch.float32) is bias  # shared by every layer
    assert bias.dtype == torch.float32 and bias.shape == (2, 1, 8, 12)
    assert torch.equal(bias == 0, prepared.dense) and torch.isinf(bias[~prepared.dense]).all()
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=prepared.dense)
    assert torch.equal(F.scaled_dot_product_attention(q, k, v, attn_mask=bias), expected)
    assert prepared.additive(torch.float64).dtype == torch.float64


def test_grouped_attention_applies_only_where_its_kernel_runs():
    q, k = torch.empty(1, 8, 4, 64), torch.empty(1, 2, 16, 64)
    assert not grouped_attention_runs(q, k, torch.zeros(1, 1, 4, 16), 0.0)  # CPU


def test_grouped_attention_refuses_bad_shapes():
    q, k = torch.empty(1, 6, 4, 8), torch.empty(1, 4, 16, 8)
    with pytest.raises(ValueError, match="liger-dspine: grouped attention needs key / value heads dividing"):
        liger_grouped_attention(q, k, k, torch.zeros(1, 1, 4, 16), 1.0)
    with pytest.raises(ValueError, match=r"liger-dspine: grouped attention needs a \[B, 1, Q, K\] bias"):
        liger_grouped_attention(q, k[:, :2], k[:, :2], torch.zeros(1, 1, 4, 16, dtype=torch.bool), 1.0)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("groups", [1, 4])
def test_grouped_attention_matches_sdpa_on_repeated_heads(dtype, groups):
    torch.manual_seed(0)
    batch, kv_heads, q_len, k_len, head_dim = 2, 2, 96, 160, 128
    heads = kv_heads * groups
    q = torch.randn(batch, heads, q_len, head_dim, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(batch, kv_heads, k_len, head_dim, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(batch, kv_heads, k_len, head_dim, device="cuda", dtype=dtype, requires_grad=True)
    prepared = PreparedMask(dense=prepare_mask(random_mask(batch, q_len, k_len, torch.Generator()).cuda()).dense)
    bias = prepared.additive(dtype)
    grad_out = torch.randn(batch, heads, q_len, head_dim, device="cuda", dtype=dtype)

    out = liger_grouped_attention(q, k, v, bias, head_dim**-0.5)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    k_rep, v_rep = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        expected = F.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=bias, scale=head_dim**-0.5)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad_out)
    assert torch.equal(out, expected)  # the same kernel on the same inputs
    # the kernel's backward accumulates in an order that varies from run to run, and the key / value gradients are
    # summed over each group in another order: half-precision rounding apart
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
