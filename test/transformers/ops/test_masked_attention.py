"""Masked grouped-query attention with tile skipping (ops/masked_attention.py) against eager attention in fp32.

The reference repeats the key-value heads, fills masked scores with -inf and zeroes the rows that see no key (the
op's contract: zeros and zero gradients there). fp32 on a CPU runs the kernels through Triton's interpreter; bf16
on CUDA against the same reference in fp32. Masks: DSpine's causal-block mask (sorted anchors, a dropped block) and
random masks with empty rows, ragged against every tile size.
"""

import pytest
import torch

from liger_dspine.models.dspine.masks import causal_block_mask
from liger_dspine.ops.masked_attention import attention_tiles
from liger_dspine.ops.masked_attention import liger_masked_attention
from liger_dspine.ops.masked_attention import tile_sizes


def eager_masked_attention(q, k, v, mask, scale):
    groups = q.shape[1] // k.shape[1]
    key = k.float().repeat_interleave(groups, dim=1)
    value = v.float().repeat_interleave(groups, dim=1)
    scores = torch.matmul(q.float(), key.transpose(2, 3)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    seen = mask.any(dim=-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(~seen, 0.0), dim=-1) * seen
    return torch.matmul(probs, value).transpose(1, 2)  # [B, Q, N, D]


def dspine_mask(batch, blocks, block_size, context, seed=0):
    generator = torch.Generator().manual_seed(seed)
    anchors = torch.stack([torch.randperm(context - 1, generator=generator)[:blocks] + 1 for _ in range(batch)])
    anchors = anchors.sort(dim=1).values
    keep = torch.ones(batch, blocks, dtype=torch.bool)
    keep[0, 1] = False  # a dropped block: rows that see nothing
    return causal_block_mask(anchors, keep, context, block_size)


def random_mask(batch, q_len, k_len, density, seed=0):
    generator = torch.Generator().manual_seed(seed)
    mask = torch.rand(batch, 1, q_len, k_len, generator=generator) < density
    mask[:, :, 3] = False  # an empty row
    mask[:, :, 5:9, :40] = False  # a stretch of empty tiles
    return mask


def make_qkv(batch, heads, kv_heads, q_len, k_len, head_dim, device, dtype, seed=1, transposed=True):
    generator = torch.Generator().manual_seed(seed)
    if transposed:  # [B, T, N, D] storage seen as [B, N, T, D], as DSpine's attention makes them
        q = torch.randn(batch, q_len, heads, head_dim, generator=generator).transpose(1, 2)
        k = torch.randn(batch, k_len, kv_heads, head_dim, generator=generator).transpose(1, 2)
        v = torch.randn(batch, k_len, kv_heads, head_dim, generator=generator).transpose(1, 2)
    else:
        q = torch.randn(batch, heads, q_len, head_dim, generator=generator)
        k = torch.randn(batch, kv_heads, k_len, head_dim, generator=generator)
        v = torch.randn(batch, kv_heads, k_len, head_dim, generator=generator)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v)]


def run(fn, q, k, v, *args, **kwargs):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = fn(*leaves, *args, **kwargs)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.device)
    (out.float() * upstream).sum().backward()
    return out.float(), [leaf.grad.float() for leaf in leaves]


def assert_matches(q, k, v, mask, scale, atol, rtol, **kwargs):
    out, grads = run(liger_masked_attention, q, k, v, mask, scale, **kwargs)
    ref, ref_grads = run(eager_masked_attention, q.float(), k.float(), v.float(), mask.to(q.device), scale)
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    for name, grad, ref_grad in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad, atol=atol, rtol=rtol, msg=f"d{name}")
    return out, grads


@pytest.mark.parametrize("head_dim", [16, 32])
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (3, 3)])
def test_dspine_mask_matches_eager_fp32(device, head_dim, heads, kv_heads):
    mask = dspine_mask(batch=2, blocks=5, block_size=16, context=37).to(device)
    q, k, v = make_qkv(2, heads, kv_heads, mask.shape[2], mask.shape[3], head_dim, device, torch.float32)
    out, grads = assert_matches(q, k, v, mask, head_dim**-0.5, atol=2e-5, rtol=2e-5)
    dropped = slice(16, 32)  # block 1 of the first sample
    assert out[0, dropped].abs().max() == 0 and grads[0][0, :, dropped].abs().max() == 0


@pytest.mark.parametrize("density", [0.05, 0.6])
def test_random_mask_with_empty_rows_and_a_broadcast_batch(device, density):
    mask = random_mask(1, 70, 101, density).to(device)
    q, k, v = make_qkv(2, 4, 1, 70, 101, 16, device, torch.float32, transposed=False)
    assert_matches(q, k, v, mask, 0.3, atol=2e-5, rtol=2e-5)


def test_tiles_are_shared_and_checked(device):
    mask = dspine_mask(batch=2, blocks=4, block_size=16, context=20).to(device)
    q, k, v = make_qkv(2, 2, 1, mask.shape[2], mask.shape[3], 16, device, torch.float32)
    tiles = attention_tiles(mask, tile_sizes(torch.float32, 16))
    assert_matches(q, k, v, mask, 0.25, atol=2e-5, rtol=2e-5, tiles=tiles)
    wrong = attention_tiles(mask, tile_sizes(torch.float16, 16))
    with pytest.raises(ValueError, match="tiles were made for"):
        liger_masked_attention(q, k, v, mask, 0.25, tiles=wrong)


def test_tile_lists_name_exactly_the_visible_tiles():
    mask = random_mask(2, 70, 101, 0.02)
    sizes = tile_sizes(torch.float32, 16)
    tiles = attention_tiles(mask, sizes)
    for b in range(2):
        for row in range(tiles.key_counts.shape[1]):
            block = mask[b, 0, row * sizes.query : (row + 1) * sizes.query]
            expected = [
                col
                for col in range(tiles.key_tiles.shape[2])
                if block[:, col * sizes.key : (col + 1) * sizes.key].any()
            ]
            count = int(tiles.key_counts[b, row])
            assert tiles.key_tiles[b, row, :count].tolist() == expected
        for col in range(tiles.query_counts.shape[1]):
            block = mask[b, 0, :, col * sizes.dkv_key : (col + 1) * sizes.dkv_key]
            expected = [
                row
                for row in range(tiles.query_tiles.shape[2])
                if block[row * sizes.dkv_query : (row + 1) * sizes.dkv_query].any()
            ]
            count = int(tiles.query_counts[b, col])
            assert tiles.query_tiles[b, col, :count].tolist() == expected


def test_bad_inputs_are_named(device):
    q, k, v = make_qkv(1, 4, 2, 8, 12, 16, device, torch.float32)
    mask = torch.ones(1, 1, 8, 12, dtype=torch.bool, device=device)
    with pytest.raises(ValueError, match="bool mask"):
        liger_masked_attention(q, k, v, mask.float(), 0.25)
    with pytest.raises(ValueError, match="bool mask"):
        liger_masked_attention(q, k, v, mask[..., :11], 0.25)
    with pytest.raises(ValueError, match="heads dividing 4"):
        liger_masked_attention(q, k[:, :1].expand(1, 3, 12, 16), v, mask, 0.25)
    with pytest.raises(ValueError, match="one dtype"):
        liger_masked_attention(q, k.half(), v, mask, 0.25)
    q24, k24, v24 = make_qkv(1, 2, 2, 8, 12, 24, device, torch.float32)
    with pytest.raises(ValueError, match="power of two"):
        liger_masked_attention(q24, k24, v24, mask, 0.25)


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cuda_bf16_against_fp32(head_dim):
    mask = dspine_mask(batch=2, blocks=24, block_size=16, context=300).cuda()
    q, k, v = make_qkv(2, 8, 2, mask.shape[2], mask.shape[3], head_dim, "cuda", torch.bfloat16)
    out, grads = run(liger_masked_attention, q, k, v, mask, head_dim**-0.5)
    ref, ref_grads = run(eager_masked_attention, q.float(), k.float(), v.float(), mask, head_dim**-0.5)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    for name, grad, ref_grad in zip("qkv", grads, ref_grads):
        error = (grad - ref_grad).norm() / ref_grad.norm()
        assert error < 1e-2, f"d{name}: relative L2 error {error:.2e}"


@pytest.mark.cuda
def test_cuda_fp32_and_fp16():
    mask = random_mask(2, 200, 333, 0.3).cuda()
    for dtype, tolerance in ((torch.float32, 1e-4), (torch.float16, 1e-2)):
        q, k, v = make_qkv(2, 4, 2, 200, 333, 64, "cuda", dtype)
        assert_matches(q, k, v, mask, 0.125, atol=tolerance, rtol=tolerance)
