"""Sink attention (ops/sink_attention.py) against DeepSeek-V4's eager formula: dense scores over the sliding window
and the compressed entries, the sink appended to each row's softmax and dropped.

fp32 on a CPU runs the kernels through Triton's interpreter; bf16 on CUDA against the same formula in fp32.
Shapes: 3 heads (a ragged head group), 37 queries (ragged query and key tiles), 9 compressed entries, D 16 and 32.
"""

import pytest
import torch

from liger_dspine.ops.sink_attention import liger_sink_attention


def eager_sink_attention(q, kv, sinks, window, scale, mask=None, bias=None):
    """transformers' formula on a materialised [B, 1, S, S + C] mask: sliding causal window (and ``mask``) on the
    sequence, ``bias`` on the compressed entries; fp32."""
    batch, heads, seq_len, _ = q.shape
    positions = torch.arange(seq_len, device=q.device)
    visible = (positions[None, :] <= positions[:, None]) & (positions[None, :] > positions[:, None] - window)
    sliding = torch.zeros(seq_len, seq_len, device=q.device).masked_fill(~visible, float("-inf"))
    sliding = sliding.expand(batch, 1, seq_len, seq_len)
    if mask is not None:
        sliding = sliding + mask[..., :seq_len].float()
    compressed = kv.shape[1] - seq_len
    extra = bias.float() if bias is not None else sliding.new_zeros(batch, 1, seq_len, compressed)
    full_mask = torch.cat([sliding, extra], dim=-1)
    key = kv.float()[:, None]
    scores = torch.matmul(q.float(), key.transpose(2, 3)) * scale + full_mask
    logits = torch.cat([scores, sinks.float().reshape(1, -1, 1, 1).expand(batch, -1, seq_len, 1)], dim=-1)
    probs = torch.softmax(logits - logits.max(dim=-1, keepdim=True).values, dim=-1)[..., :-1]
    return torch.matmul(probs, key).transpose(1, 2)  # [B, S, N, D]


def make_inputs(device, dtype, head_dim, compressed=9, seq_len=37, heads=3, batch=2, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq_len, head_dim, generator=generator)
    kv = torch.randn(batch, seq_len + compressed, head_dim, generator=generator)
    sinks = torch.randn(heads, generator=generator)
    # a causal threshold per query over the compressed entries, as the HCA compressor builds it (rate 4)
    entries = torch.arange(compressed)
    threshold = (torch.arange(seq_len) + 1) // 4
    bias = torch.zeros(batch, 1, seq_len, compressed).masked_fill(entries[None, :] >= threshold[:, None], -torch.inf)
    mask = torch.randn(batch, 1, seq_len, seq_len, generator=generator) * 0.5
    to = dict(device=device, dtype=dtype)
    return q.to(**to), kv.to(**to), sinks.to(device), bias.to(**to), mask.to(**to)


def run(fn, q, kv, sinks, *args, **kwargs):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, kv, sinks)]
    out = fn(*leaves, *args, **kwargs)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.device)
    (out.float() * upstream).sum().backward()
    return out.float(), [leaf.grad.float() for leaf in leaves]


@pytest.mark.parametrize("head_dim", [16, 32])
@pytest.mark.parametrize("window", [1, 5, 64])
@pytest.mark.parametrize("with_mask, with_bias", [(False, False), (True, True), (False, True)])
def test_matches_eager_fp32(device, head_dim, window, with_mask, with_bias):
    q, kv, sinks, bias, mask = make_inputs(device, torch.float32, head_dim)
    kwargs = dict(mask=mask if with_mask else None, bias=bias if with_bias else None)
    scale = head_dim**-0.5
    out, grads = run(liger_sink_attention, q, kv, sinks, window, scale, **kwargs)
    ref, ref_grads = run(eager_sink_attention, q, kv, sinks, window, scale, **kwargs)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    for name, grad, ref_grad in zip(("q", "kv", "sinks"), grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad, atol=5e-5, rtol=5e-5, msg=name)


def test_mask_wider_than_the_sequence_and_broadcast_over_the_batch(device):
    """A [1, 1, S, S + C] mask (as transformers concatenates it): only its first S columns are read."""
    q, kv, sinks, bias, mask = make_inputs(device, torch.float32, 16)
    wide = torch.cat([mask[:1], torch.full_like(bias[:1], 123.0)], dim=-1)
    out, grads = run(liger_sink_attention, q, kv, sinks, 6, 0.25, mask=wide, bias=bias)
    ref, ref_grads = run(eager_sink_attention, q, kv, sinks, 6, 0.25, mask=mask[:1], bias=bias)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad, atol=5e-5, rtol=5e-5)


def test_compressed_backward_split_in_query_chunks(device, monkeypatch):
    """The compressed tiles' backward in chunks of 16 queries (37 queries: 3 chunks, the last ragged), the head groups'
    shares added up."""
    from liger_dspine.ops import sink_attention

    monkeypatch.setattr(sink_attention, "QUERY_CHUNK", 16)
    q, kv, sinks, bias, mask = make_inputs(device, torch.float32, 16, compressed=40, heads=5)
    out, grads = run(liger_sink_attention, q, kv, sinks, 7, 0.25, mask=mask, bias=bias)
    ref, ref_grads = run(eager_sink_attention, q, kv, sinks, 7, 0.25, mask=mask, bias=bias)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad, atol=5e-5, rtol=5e-5)


def test_bad_arguments_are_named(device):
    q, kv, sinks, bias, mask = make_inputs(device, torch.float32, 16)
    with pytest.raises(ValueError, match="kv"):
        liger_sink_attention(q, kv[..., :8], sinks, 4, 0.25)
    with pytest.raises(ValueError, match="one dtype"):
        liger_sink_attention(q, kv.double(), sinks, 4, 0.25)
    with pytest.raises(ValueError, match="power of two"):
        liger_sink_attention(q[..., :12], kv[..., :12], sinks, 4, 0.25)
    with pytest.raises(ValueError, match="sinks"):
        liger_sink_attention(q, kv, sinks[:2], 4, 0.25)
    with pytest.raises(ValueError, match="window"):
        liger_sink_attention(q, kv, sinks, 0, 0.25)
    with pytest.raises(ValueError, match="bias"):
        liger_sink_attention(q, kv, sinks, 4, 0.25, bias=bias[..., :3])
    with pytest.raises(ValueError, match="mask"):
        liger_sink_attention(q, kv, sinks, 4, 0.25, mask=mask[..., :5, :])


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", [64, 512])
def test_cuda_bf16_against_fp32(head_dim):
    q, kv, sinks, bias, mask = make_inputs("cuda", torch.bfloat16, head_dim, compressed=40, seq_len=300, heads=8)
    scale = head_dim**-0.5
    out, grads = run(liger_sink_attention, q, kv, sinks, 128, scale, mask=mask, bias=bias)
    ref, ref_grads = run(eager_sink_attention, q.float(), kv.float(), sinks, 128, scale, mask=mask, bias=bias)
    # bf16 inputs and outputs, fp32 scores and sums: within 2e-2 (relative L2) of the fp32 formula on the same inputs
    for got, expected in zip([out, *grads], [ref, *ref_grads]):
        assert ((got - expected).norm() / expected.norm()).item() < 2e-2


@pytest.mark.cuda
def test_cuda_offsets_past_two_to_the_31():
    """65536 queries of 64 heads of width 512 (q has 2^31 elements): the last queries' outputs against the formula
    on their own window (the kernels' offsets are 64-bit; 32-bit ones run past the end)."""
    seq_len, heads, head_dim, window, scale = 65536, 64, 512, 128, 512**-0.5
    generator = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, seq_len, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=generator)
    kv = torch.randn(1, seq_len, head_dim, device="cuda", dtype=torch.bfloat16, generator=generator)
    sinks = torch.zeros(heads, device="cuda")
    out = liger_sink_attention(q.transpose(1, 2), kv, sinks, window, scale)  # [1, S, N, D]
    last = slice(seq_len - 16, seq_len)
    keys = kv[:, seq_len - 16 - window + 1 :].float()  # every key the last 16 queries see
    scores = torch.einsum("bsnd,btd->bnst", q[:, last].float(), keys) * scale
    offset = torch.arange(16, device="cuda")[:, None] + window - 1 - torch.arange(keys.shape[1], device="cuda")
    scores = scores.masked_fill((offset < 0) | (offset >= window), float("-inf"))
    logits = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(1, -1, 16, 1)], dim=-1)
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    expected = torch.einsum("bnst,btd->bsnd", probs, keys)
    assert ((out[:, last].float() - expected).norm() / expected.norm()).item() < 2e-2
