"""Masked grouped-query attention with tile skipping (ops/masked_attention.py) against eager attention in fp32.

The reference repeats the key-value heads, fills masked scores with -inf and zeroes the rows that see no key (the
op's contract: zeros and zero gradients there). fp32 on a CPU runs the kernels through Triton's interpreter; bf16
on CUDA against the same reference in fp32. Masks: DSpine's causal-block mask (sorted anchors, a dropped block) and
random masks with empty rows, ragged against every tile size.
"""

import pytest
import torch

from liger_dspine.models.dspine.masks import causal_block_mask
from liger_dspine.ops.masked_attention import TileSizes
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


def test_key_and_value_views_off_16_byte_steps_are_read_right(device):
    """k with rows 17 floats apart and v starting one float into its storage: TMA cannot read either in place."""
    mask = dspine_mask(batch=1, blocks=3, block_size=16, context=30).to(device)
    q, k, v = make_qkv(1, 2, 1, mask.shape[2], mask.shape[3], 16, device, torch.float32, transposed=False)
    wide = torch.zeros(*k.shape[:3], 17, device=device)
    wide[..., :16] = k
    shifted = torch.zeros(v.numel() + 1, device=device)
    shifted[1:] = v.flatten()
    k_view, v_view = wide[..., :16], shifted[1:].view(v.shape)
    assert k_view.stride(2) == 17 and v_view.storage_offset() == 1
    out = liger_masked_attention(q, k_view, v_view, mask, 0.25)
    torch.testing.assert_close(out.float(), eager_masked_attention(q, k, v, mask, 0.25), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("k_len", [48, 45])
def test_mask_views_the_kernels_cannot_read_in_place_are_read_right(device, k_len):
    """The mask one byte into its storage (rows 16 bytes apart, or 45 bytes apart): its partial tiles' TMA copies
    need a padded plane, which must see the same pairs."""
    dense = dspine_mask(batch=2, blocks=2, block_size=16, context=k_len - 32).to(device)
    storage = torch.zeros(dense.numel() + 1, dtype=torch.bool, device=device)
    storage[1:] = dense.flatten()
    mask = storage[1:].view(dense.shape)
    assert mask.storage_offset() == 1 and mask.shape[3] == k_len
    q, k, v = make_qkv(2, 2, 1, mask.shape[2], k_len, 16, device, torch.float32)
    assert_matches(q, k, v, mask, 0.25, atol=2e-5, rtol=2e-5)
    assert_matches(q, k, v, mask[:1], 0.25, atol=2e-5, rtol=2e-5)  # broadcast over the batch


def test_a_mask_broadcast_over_its_queries_is_read_right(device):
    """A key-padding mask expanded over the queries (row stride 0, which TMA cannot take): a padded copy is read."""
    keys = torch.rand(2, 1, 1, 48, generator=torch.Generator().manual_seed(3)) < 0.5
    mask = keys.to(device).expand(2, 1, 40, 48)
    assert mask.stride(2) == 0
    q, k, v = make_qkv(2, 2, 1, 40, 48, 16, device, torch.float32)
    assert_matches(q, k, v, mask, 0.25, atol=2e-5, rtol=2e-5)


def test_tiles_carry_the_mask_plane_made_once(device):
    """A mask the kernels cannot read in place is copied once, by attention_tiles: its plane holds the mask's pairs
    with rows on 16 bytes, the ops read that plane as it is, and calls sharing the tiles match eager."""
    from liger_dspine.ops.masked_attention import _tma_mask_plane

    mask = dspine_mask(batch=2, blocks=2, block_size=16, context=13).to(device)  # 45 keys: rows off 16 bytes
    tiles = attention_tiles(mask, tile_sizes(torch.float32, 16))
    plane = tiles.plane
    assert plane.dtype == torch.uint8 and tuple(plane.shape) == (2, mask.shape[2], 45)
    assert plane.stride(1) % 16 == 0 and plane.data_ptr() % 16 == 0
    assert torch.equal(plane.bool(), mask[:, 0])
    assert _tma_mask_plane(plane) is plane
    q, k, v = make_qkv(2, 2, 1, mask.shape[2], 45, 16, device, torch.float32)
    for _ in range(2):
        assert_matches(q, k, v, mask, 0.25, atol=2e-5, rtol=2e-5, tiles=tiles)


def test_a_triton_allocator_set_by_the_caller_is_kept(device):
    from triton.runtime import _allocation

    def caller_allocator(size, alignment, stream):
        return torch.empty(size, dtype=torch.int8, device=device)

    token = _allocation._allocator.set(caller_allocator)
    try:
        mask = dspine_mask(batch=1, blocks=2, block_size=16, context=20).to(device)
        q, k, v = make_qkv(1, 2, 1, mask.shape[2], mask.shape[3], 16, device, torch.float32)
        assert_matches(q, k, v, mask, 0.25, atol=2e-5, rtol=2e-5)
        assert _allocation._allocator.get() is caller_allocator
    finally:
        _allocation._allocator.reset(token)


def test_tiles_are_shared_and_checked(device):
    mask = dspine_mask(batch=2, blocks=4, block_size=16, context=20).to(device)
    q, k, v = make_qkv(2, 2, 1, mask.shape[2], mask.shape[3], 16, device, torch.float32)
    tiles = attention_tiles(mask, tile_sizes(torch.float32, 16))
    assert_matches(q, k, v, mask, 0.25, atol=2e-5, rtol=2e-5, tiles=tiles)
    wrong = attention_tiles(mask, tile_sizes(torch.float16, 16))
    with pytest.raises(ValueError, match="tiles were made for"):
        liger_masked_attention(q, k, v, mask, 0.25, tiles=wrong)
    shorter = attention_tiles(mask[..., :-1], tile_sizes(torch.float32, 16))  # another mask's shape
    with pytest.raises(ValueError, match="tiles were made for"):
        liger_masked_attention(q, k, v, mask, 0.25, tiles=shorter)


def _expected_list(mask_rows_or_cols, size, count, along_keys) -> tuple[list[int], int]:
    """The tiles a list names: full ones (inside the mask, every pair visible) first, then partial ones, each
    ascending; and how many are full."""
    blocks = [
        mask_rows_or_cols[:, i * size : (i + 1) * size] if along_keys else mask_rows_or_cols[i * size : (i + 1) * size]
        for i in range(count)
    ]
    inside = [block.shape[1 if along_keys else 0] == size for block in blocks]
    full = [i for i, block in enumerate(blocks) if inside[i] and block.all()]
    partial = [i for i, block in enumerate(blocks) if block.any() and i not in full]
    return full + partial, len(full)


@pytest.mark.parametrize("density", [0.02, 0.9])
@pytest.mark.parametrize("sizes", [(64, 32, 32, 32), (128, 128, 64, 64), (32, 64, 16, 128)])
def test_tile_lists_name_exactly_the_visible_tiles_full_first(density, sizes):
    mask = random_mask(2, 170, 301, density)
    mask[1, 0, :128, :128] = True  # full tiles in both lists
    sizes = TileSizes(*sizes)
    tiles = attention_tiles(mask, sizes)
    full_seen = 0
    for b in range(2):
        for row in range(tiles.key_counts.shape[1]):
            rows = mask[b, 0, row * sizes.query : (row + 1) * sizes.query]
            if rows.shape[0] < sizes.query:  # a tile reaching past the mask is never full
                rows = torch.cat([rows, rows.new_zeros(sizes.query - rows.shape[0], rows.shape[1])])
            expected, full = _expected_list(rows, sizes.key, tiles.key_tiles.shape[2], along_keys=True)
            count = int(tiles.key_counts[b, row])
            assert tiles.key_tiles[b, row, :count].tolist() == expected
            assert int(tiles.key_full[b, row]) == full
            full_seen += full
        for col in range(tiles.query_counts.shape[1]):
            cols = mask[b, 0, :, col * sizes.dkv_key : (col + 1) * sizes.dkv_key]
            if cols.shape[1] < sizes.dkv_key:
                cols = torch.cat([cols, cols.new_zeros(cols.shape[0], sizes.dkv_key - cols.shape[1])], dim=1)
            expected, full = _expected_list(cols, sizes.dkv_query, tiles.query_tiles.shape[2], along_keys=False)
            count = int(tiles.query_counts[b, col])
            assert tiles.query_tiles[b, col, :count].tolist() == expected
            assert int(tiles.query_full[b, col]) == full
            full_seen += full
        for order, counts in ((tiles.key_order[b], tiles.key_counts[b]), (tiles.query_order[b], tiles.query_counts[b])):
            # every tile launched once, the longest lists first, ties in tile order
            expected = sorted(range(counts.shape[0]), key=lambda tile: (-int(counts[tile]), tile))
            assert order.tolist() == expected
    assert full_seen > 0


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (2, 2)])
def test_full_and_partial_tiles_match_eager_fp32(device, heads, kv_heads):
    """A causal mask and a DSpine mask over a long context: most visited tiles are full (no mask read)."""
    causal = torch.ones(130, 150, dtype=torch.bool).tril(diagonal=20)[None, None].expand(2, 1, 130, 150).clone()
    causal[1, 0, 7] = False  # an empty row inside a tile of the second sample
    for mask in (causal, dspine_mask(batch=2, blocks=8, block_size=16, context=400)):
        mask = mask.to(device)
        tiles = attention_tiles(mask, tile_sizes(torch.float32, 16))
        assert tiles.key_full.sum() > 0 and tiles.query_full.sum() > 0
        assert (tiles.key_full < tiles.key_counts).any() and (tiles.query_full < tiles.query_counts).any()
        q, k, v = make_qkv(2, heads, kv_heads, mask.shape[2], mask.shape[3], 16, device, torch.float32)
        assert_matches(q, k, v, mask, 0.25, atol=2e-5, rtol=2e-5, tiles=tiles)


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


@pytest.mark.parametrize(
    "shared_kib, expected", [(227, (128, 128, 64, 64, 8, 2, 8, 2, 4, 3)), (163, (128, 64, 64, 64, 8, 3, 8, 3, 8, 3))]
)
def test_half_precision_settings_follow_the_gpus_shared_memory(monkeypatch, shared_kib, expected):
    """The swept settings need Hopper's shared memory per block; smaller GPUs (A100, Ada) keep the smaller ones. fp32
    and a CPU take their own."""
    from liger_dspine.ops import masked_attention

    monkeypatch.setattr(masked_attention, "_shared_memory_per_block", lambda index: shared_kib * 1024)
    assert tuple(tile_sizes(torch.bfloat16, 128, torch.device("cuda", 0))) == expected
    assert tuple(tile_sizes(torch.float16, 64, "cuda:0")) == expected
    assert tuple(tile_sizes(torch.bfloat16, 256, "cuda:0")) == (64, 32, 32, 32, 4, 2, 4, 2, 4, 2)
    assert tuple(tile_sizes(torch.float32, 128, "cuda:0")) == (64, 32, 32, 32, 4, 2, 4, 2, 4, 2)
    assert tuple(tile_sizes(torch.bfloat16, 128, "cpu")) == (128, 64, 64, 64, 8, 3, 8, 3, 8, 3)
