"""Grouped-query attention under a boolean mask that skips the key tiles a query tile cannot see.

A draft block's queries see the context before their anchor and their own block's keys: in DSpine's step (8192
queries over 3072 context + 8192 draft keys) about 15% of the [Q, K] tiles hold a visible pair. sdpa's kernels take
such a mask as an additive bias and compute every tile. Here the mask is first reduced to a tile map (which
[BLOCK, BLOCK] tiles hold any visible pair, a list of them per query tile and per key tile, full tiles first), and
the kernels visit only those tiles. A full tile (every pair visible: most of a block's context) is computed without
reading the mask or bounds; a partial tile's part of the mask is copied by TMA (as a uint8 plane whose rows start on
16 bytes). The programs with the longest lists launch first, and the heads of one tile side by side (they read the
same key or query tiles):

- forward: per (query tile, head), an online softmax over the listed key tiles; out and a log-sum-exp per row;
- dq: per (query tile, head), ``scale * sum_t p_t (dO.v_t - delta) k_t`` over the same tiles;
- dk / dv: per (key tile, key-value head), the listed query tiles of every query head of the group, summed in the
  program (no atomics): ``dv += p^T dO``, ``dk += scale * (p * (dO.v - delta))^T q``.

with delta = rowsum(dO * out). Key and value keep their key-value heads; nothing of size [Q, K] is stored. A query
row that sees no key returns zeros and gets zero gradients. Scores, softmax and accumulators are fp32; products take
the inputs' dtype, as flash attention does.
"""

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import is_fake

from liger_dspine._interpreter import check_kernel_device
from liger_dspine._interpreter import kernel_runs_on
from liger_dspine.ops.eager_dispatch import liger_custom_op
from liger_dspine.ops.first_order import first_order_only
from liger_dspine.ops.precompile import precompile


class TileSizes(NamedTuple):
    """Tile sizes and launch settings of the three kernels (tile lists depend on the first four only)."""

    query: int  # rows of a forward / dq program
    key: int  # keys per step of a forward / dq program
    dkv_key: int  # keys of a dk / dv program
    dkv_query: int  # rows per step of a dk / dv program
    forward_warps: int = 4
    forward_stages: int = 2
    dq_warps: int = 4
    dq_stages: int = 2
    dkv_warps: int = 4
    dkv_stages: int = 2


# Shared memory per block from which the tuned half-precision settings run: H100 / H200 (227 KiB), not A100 (163 KiB)
_TUNED_SHARED_MEMORY = 200 * 1024


@torch._dynamo.assume_constant_result
def _shared_memory_per_block(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).shared_memory_per_block_optin


def tile_sizes(dtype: torch.dtype, head_dim: int, device: torch.device | None = None) -> TileSizes:
    """Half precision up to D = 128 takes the large tiles: on a GPU with Hopper's shared memory the settings measured
    best there (``bench_masked_attention.py --sweep``), elsewhere smaller ones; fp32 or wider heads halve them."""
    if dtype in (torch.bfloat16, torch.float16) and head_dim <= 128:
        cuda = device is not None and torch.device(device).type == "cuda"
        index = torch.device(device).index if cuda else None
        if cuda and _shared_memory_per_block(torch.cuda.current_device() if index is None else index) >= (
            _TUNED_SHARED_MEMORY
        ):
            return TileSizes(128, 128, 64, 64, 8, 2, 8, 2, 4, 3)
        return TileSizes(128, 64, 64, 64, 8, 3, 8, 3, 8, 3)
    return TileSizes(64, 32, 32, 32)


class AttentionTiles(NamedTuple):
    """Which tiles of a [B, 1, Q, K] mask hold a visible pair, as lists: first the full tiles (every pair visible
    and in range), then the partial ones, each ascending."""

    sizes: TileSizes
    key_tiles: torch.Tensor  # int32 [B, Q / query, K / key]: per query tile, its visible key tiles
    key_counts: torch.Tensor  # int32 [B, Q / query]
    key_full: torch.Tensor  # int32 [B, Q / query]: how many of them are full
    key_order: torch.Tensor  # int32 [B, Q / query]: the query tiles by descending count (forward / dq launch order)
    query_tiles: torch.Tensor  # int32 [B, K / dkv_key, Q / dkv_query]: per key tile, its visible query tiles
    query_counts: torch.Tensor  # int32 [B, K / dkv_key]
    query_full: torch.Tensor  # int32 [B, K / dkv_key]
    query_order: torch.Tensor  # int32 [B, K / dkv_key]: the key tiles by descending count (dk / dv launch order)
    plane: torch.Tensor  # uint8 [B, Q, K]: the mask as the kernels read it (rows on 16 bytes; see _tma_mask_plane)


def _pad_to(tensor: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Zeros appended to the last two dims up to multiples of ``rows`` and ``cols``."""
    extra_rows, extra_cols = -tensor.shape[-2] % rows, -tensor.shape[-1] % cols
    return F.pad(tensor, (0, extra_cols, 0, extra_rows)) if extra_rows or extra_cols else tensor


def _block_sums(tensor: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """[B, R, C] -> [B, ceil(R / rows), ceil(C / cols)] int32: the sums of its [rows, cols] blocks."""
    padded = _pad_to(tensor, rows, cols)
    batch, height, width = padded.shape
    blocks = padded.view(batch, height // rows, rows, width // cols, cols)
    return blocks.sum(dim=(2, 4), dtype=torch.int32)


def _lists(counts: torch.Tensor, tile_pairs: int) -> tuple[torch.Tensor, ...]:
    """Visible pairs per tile [B, R, C] -> (the indices of the full tiles, then of the partial ones, each ascending,
    then the rest, [B, R, C] int32; the counts of visible tiles [B, R]; of full tiles [B, R]; the rows by descending
    count [B, R] int32). Launched longest first, the short programs fill the last wave."""
    visible, full = counts > 0, counts == tile_pairs
    rank = (~visible).to(torch.uint8) + (~full).to(torch.uint8)  # 0 full, 1 partial, 2 not visible
    order = torch.sort(rank, dim=-1, stable=True).indices
    visible_counts = visible.sum(dim=-1, dtype=torch.int32)
    launch_order = torch.sort(visible_counts, dim=-1, descending=True, stable=True).indices
    return order.to(torch.int32), visible_counts, full.sum(dim=-1, dtype=torch.int32), launch_order.to(torch.int32)


def attention_tiles(mask: torch.Tensor, sizes: TileSizes) -> AttentionTiles:
    """The tile lists of a bool mask [B, 1, Q, K] for tiles of ``sizes``, and the mask's plane: one pass over the
    mask counts the visible pairs of the finest tiles both lists are made of (a tile reaching past the mask counts
    the missing part as not visible, so it is never full), then two small sums and two sorts. A mask shared by
    several layers needs them once."""
    fine_rows, fine_cols = math.gcd(sizes.query, sizes.dkv_query), math.gcd(sizes.key, sizes.dkv_key)
    counts = _block_sums(mask[:, 0].view(torch.uint8), fine_rows, fine_cols)
    by_query = _block_sums(counts, sizes.query // fine_rows, sizes.key // fine_cols)
    by_key = _block_sums(counts, sizes.dkv_query // fine_rows, sizes.dkv_key // fine_cols).transpose(1, 2)
    key_lists = _lists(by_query, sizes.query * sizes.key)
    query_lists = [t.contiguous() for t in _lists(by_key, sizes.dkv_query * sizes.dkv_key)]
    return AttentionTiles(sizes, *key_lists, *query_lists, _tma_mask_plane(mask[:, 0].view(torch.uint8)))


# ----------------------------------------------------------------------------------------------------------- kernels
# The softmax works in base 2: q.k is scaled by scale * log2(e) inside exp2's argument (one FMA with the shift), and
# the running maximum is kept in those units; the stored log-sum-exp is in base e.
@triton.jit
def _load_rows(base, rows, row_ok, stride, dims, PARTIAL: tl.constexpr):
    """[len(rows), D] at ``base + rows * stride``; rows out of range read zeros (only a partial tile has any)."""
    pointers = base + rows[:, None] * stride + dims[None, :]
    if PARTIAL:
        return tl.load(pointers, mask=row_ok[:, None], other=0.0)
    return tl.load(pointers)


@triton.jit
def _load_stats(pointers, row_ok, other, PARTIAL: tl.constexpr):
    if PARTIAL:
        return tl.load(pointers, mask=row_ok, other=other)
    return tl.load(pointers)


@triton.jit
def _key_value_descriptors(k_base, v_base, k_len, stride_ks, stride_vs, BLOCK_K: tl.constexpr, HEAD_DIM: tl.constexpr):
    """TMA descriptors of one key-value head's k and v [k_len, D]: a forward / dq program's key tiles are copied by
    the tensor memory accelerator, rows past k_len read as zeros."""
    k_desc = tl.make_tensor_descriptor(k_base, [k_len, HEAD_DIM], [stride_ks, 1], [BLOCK_K, HEAD_DIM])
    v_desc = tl.make_tensor_descriptor(v_base, [k_len, HEAD_DIM], [stride_vs, 1], [BLOCK_K, HEAD_DIM])
    return k_desc, v_desc


@triton.jit
def _mask_descriptor(mask_base, q_len, k_len, stride_mq, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr):
    """TMA descriptor of one batch row's mask [q_len, k_len] (uint8): a partial tile's part of it is copied by the
    tensor memory accelerator with its key and value tiles, pairs out of range read as 0 (hidden)."""
    return tl.make_tensor_descriptor(mask_base, [q_len, k_len], [stride_mq, 1], [BLOCK_Q, BLOCK_K])


@triton.jit
def _key_tile_scores(
    key_tile, q, k_desc, v_desc, mask_desc, row_start,
    BLOCK_K: tl.constexpr, PARTIAL: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """(k, v, scores q.k [rows, keys], unscaled) of one key tile of a forward / dq program, -inf where a partial
    tile's mask hides a pair (or the pair is out of range)."""
    k = k_desc.load([key_tile * BLOCK_K, 0])
    v = v_desc.load([key_tile * BLOCK_K, 0])
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if PARTIAL:
        visible = mask_desc.load([row_start, key_tile * BLOCK_K])
        scores = tl.where(visible != 0, scores, float("-inf"))
    return k, v, scores


@triton.jit
def _forward_visits(
    acc, running_max, running_sum, q, k_desc, v_desc, mask_desc, list_ptr, start, end, row_start, qk_scale,
    BLOCK_K: tl.constexpr, PARTIAL: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The online softmax over the key tiles ``list_ptr[start:end]``. Full tiles (PARTIAL off) read neither the
    mask nor bounds."""
    for i in range(start, end):
        k, v, scores = _key_tile_scores(
            tl.load(list_ptr + i), q, k_desc, v_desc, mask_desc, row_start, BLOCK_K, PARTIAL, PRECISION
        )
        new_max = tl.maximum(running_max, tl.max(scores, axis=1) * qk_scale)
        shift = new_max
        if PARTIAL:
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # rows with nothing visible yet stay at zero
        p = tl.math.exp2(scores * qk_scale - shift[:, None])
        alpha = tl.math.exp2(running_max - shift)
        running_sum = running_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        running_max = new_max
    return acc, running_max, running_sum


_SIZES = ("q_len", "k_len", "num_heads", "groups", "list_len", "stride_mb", "stride_mq")


@triton.jit(do_not_specialize=_SIZES)
def _masked_attention_forward_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, tiles_ptr, counts_ptr, full_ptr, order_ptr, out_ptr, lse_ptr,
    q_len, k_len, num_heads, groups, list_len, scale,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_mb, stride_mq, stride_ob, stride_oh, stride_os,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    head = tl.program_id(1).to(tl.int64)
    batch = tl.program_id(2).to(tl.int64)
    q_tile = tl.load(order_ptr + batch * tl.num_programs(0) + tl.program_id(0))
    kv_head = head // groups
    rows = (q_tile * BLOCK_Q + tl.arange(0, BLOCK_Q)).to(tl.int64)
    row_ok = rows < q_len
    dims = tl.arange(0, HEAD_DIM)
    q = _load_rows(q_ptr + batch * stride_qb + head * stride_qh, rows, row_ok, stride_qs, dims, True)
    k_desc, v_desc = _key_value_descriptors(
        k_ptr + batch * stride_kb + kv_head * stride_kh, v_ptr + batch * stride_vb + kv_head * stride_vh, k_len,
        stride_ks, stride_vs, BLOCK_K, HEAD_DIM,
    )  # fmt: skip
    mask_desc = _mask_descriptor(mask_ptr + batch * stride_mb, q_len, k_len, stride_mq, BLOCK_Q, BLOCK_K)
    list_row = batch * tl.num_programs(0) + q_tile
    list_ptr = tiles_ptr + list_row * list_len
    full = tl.load(full_ptr + list_row)
    count = tl.load(counts_ptr + list_row)
    qk_scale = scale * 1.4426950408889634  # log2(e)
    running_max = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, HEAD_DIM], tl.float32)
    acc, running_max, running_sum = _forward_visits(
        acc, running_max, running_sum, q, k_desc, v_desc, mask_desc, list_ptr, 0, full, q_tile * BLOCK_Q, qk_scale,
        BLOCK_K, False, PRECISION,
    )  # fmt: skip
    acc, running_max, running_sum = _forward_visits(
        acc, running_max, running_sum, q, k_desc, v_desc, mask_desc, list_ptr, full, count, q_tile * BLOCK_Q,
        qk_scale, BLOCK_K, True, PRECISION,
    )  # fmt: skip
    empty = running_sum == 0.0
    out = acc / tl.where(empty, 1.0, running_sum)[:, None]
    tl.store(
        out_ptr + batch * stride_ob + head * stride_oh + rows[:, None] * stride_os + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )
    log2_sum = running_max + tl.log2(tl.where(empty, 1.0, running_sum))
    lse = tl.where(empty, float("inf"), log2_sum * 0.6931471805599453)  # base e; +inf: p = 0 in the backward
    tl.store(lse_ptr + (batch * num_heads + head) * q_len + rows, lse, mask=row_ok)


@triton.jit
def _dq_visits(
    acc, q, grad_out, lse2, delta, k_desc, v_desc, mask_desc, list_ptr, start, end, row_start, qk_scale,
    BLOCK_K: tl.constexpr, PARTIAL: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """acc += sum over the key tiles ``list_ptr[start:end]`` of p (dO.v - delta) k."""
    for i in range(start, end):
        k, v, scores = _key_tile_scores(
            tl.load(list_ptr + i), q, k_desc, v_desc, mask_desc, row_start, BLOCK_K, PARTIAL, PRECISION
        )
        p = tl.math.exp2(scores * qk_scale - lse2[:, None])
        grad_p = tl.dot(grad_out, tl.trans(v), input_precision=PRECISION)
        grad_scores = p * (grad_p - delta[:, None])
        acc += tl.dot(grad_scores.to(k.dtype), k, input_precision=PRECISION)
    return acc


@triton.jit(do_not_specialize=_SIZES)
def _masked_attention_dq_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, tiles_ptr, counts_ptr, full_ptr, order_ptr, grad_out_ptr, lse_ptr, delta_ptr,
    grad_q_ptr,
    q_len, k_len, num_heads, groups, list_len, scale,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_mb, stride_mq, stride_ob, stride_oh, stride_os,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """dq with q's strides; grad_out with the strides stride_o*."""
    head = tl.program_id(1).to(tl.int64)
    batch = tl.program_id(2).to(tl.int64)
    q_tile = tl.load(order_ptr + batch * tl.num_programs(0) + tl.program_id(0))
    kv_head = head // groups
    rows = (q_tile * BLOCK_Q + tl.arange(0, BLOCK_Q)).to(tl.int64)
    row_ok = rows < q_len
    dims = tl.arange(0, HEAD_DIM)
    q_offset = batch * stride_qb + head * stride_qh
    q = _load_rows(q_ptr + q_offset, rows, row_ok, stride_qs, dims, True)
    grad_out = _load_rows(grad_out_ptr + batch * stride_ob + head * stride_oh, rows, row_ok, stride_os, dims, True)
    stats = (batch * num_heads + head) * q_len + rows
    lse2 = tl.load(lse_ptr + stats, mask=row_ok, other=float("inf")) * 1.4426950408889634
    delta = tl.load(delta_ptr + stats, mask=row_ok, other=0.0)
    k_desc, v_desc = _key_value_descriptors(
        k_ptr + batch * stride_kb + kv_head * stride_kh, v_ptr + batch * stride_vb + kv_head * stride_vh, k_len,
        stride_ks, stride_vs, BLOCK_K, HEAD_DIM,
    )  # fmt: skip
    mask_desc = _mask_descriptor(mask_ptr + batch * stride_mb, q_len, k_len, stride_mq, BLOCK_Q, BLOCK_K)
    list_row = batch * tl.num_programs(0) + q_tile
    list_ptr = tiles_ptr + list_row * list_len
    full = tl.load(full_ptr + list_row)
    count = tl.load(counts_ptr + list_row)
    qk_scale = scale * 1.4426950408889634
    acc = tl.zeros([BLOCK_Q, HEAD_DIM], tl.float32)
    acc = _dq_visits(
        acc, q, grad_out, lse2, delta, k_desc, v_desc, mask_desc, list_ptr, 0, full, q_tile * BLOCK_Q, qk_scale,
        BLOCK_K, False, PRECISION,
    )  # fmt: skip
    acc = _dq_visits(
        acc, q, grad_out, lse2, delta, k_desc, v_desc, mask_desc, list_ptr, full, count, q_tile * BLOCK_Q,
        qk_scale, BLOCK_K, True, PRECISION,
    )  # fmt: skip
    grad_q_pointers = grad_q_ptr + q_offset + rows[:, None] * stride_qs + dims[None, :]
    tl.store(grad_q_pointers, (acc * scale).to(grad_q_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _dkv_visits(
    grad_k, grad_v, k, v, q_base, grad_out_base, lse_base, delta_base, mask_desc, list_ptr, start, end, key_start,
    dims, q_len, stride_qs, stride_os, qk_scale, BLOCK_Q: tl.constexpr, PARTIAL: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """dv += p^T dO and dk += (p (dO.v - delta))^T q over the query tiles ``list_ptr[start:end]`` of one query
    head; tiles are [keys, rows], so q and dO are only right operands."""
    for i in range(start, end):
        query_tile = tl.load(list_ptr + i)
        rows = (query_tile * BLOCK_Q + tl.arange(0, BLOCK_Q)).to(tl.int64)
        row_ok = rows < q_len
        q = _load_rows(q_base, rows, row_ok, stride_qs, dims, PARTIAL)
        grad_out = _load_rows(grad_out_base, rows, row_ok, stride_os, dims, PARTIAL)
        lse2 = _load_stats(lse_base + rows, row_ok, float("inf"), PARTIAL) * 1.4426950408889634
        delta = _load_stats(delta_base + rows, row_ok, 0.0, PARTIAL)
        scores = tl.dot(k, tl.trans(q), input_precision=PRECISION)
        if PARTIAL:
            visible = tl.trans(mask_desc.load([query_tile * BLOCK_Q, key_start]))
            scores = tl.where(visible != 0, scores, float("-inf"))
        p = tl.math.exp2(scores * qk_scale - lse2[None, :])
        grad_v += tl.dot(p.to(grad_out.dtype), grad_out, input_precision=PRECISION)
        grad_p = tl.dot(v, tl.trans(grad_out), input_precision=PRECISION)
        grad_scores = p * (grad_p - delta[None, :])
        grad_k += tl.dot(grad_scores.to(q.dtype), q, input_precision=PRECISION)
    return grad_k, grad_v


@triton.jit(do_not_specialize=_SIZES)
def _masked_attention_dkv_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, tiles_ptr, counts_ptr, full_ptr, order_ptr, grad_out_ptr, lse_ptr, delta_ptr,
    grad_k_ptr, grad_v_ptr, q_len, k_len, num_heads, groups, list_len, scale,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_mb, stride_mq, stride_ob, stride_oh, stride_os,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """dk / dv of one key tile and key-value head, summed over every query head of its group in the program; dk
    has k's strides and dv v's."""
    kv_head = tl.program_id(0).to(tl.int64)
    batch = tl.program_id(2).to(tl.int64)
    key_tile = tl.load(order_ptr + batch * tl.num_programs(1) + tl.program_id(1))
    keys = (key_tile * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)
    key_ok = keys < k_len
    dims = tl.arange(0, HEAD_DIM)
    k_offsets = batch * stride_kb + kv_head * stride_kh + keys[:, None] * stride_ks + dims[None, :]
    v_offsets = batch * stride_vb + kv_head * stride_vh + keys[:, None] * stride_vs + dims[None, :]
    k = tl.load(k_ptr + k_offsets, mask=key_ok[:, None], other=0.0)
    v = tl.load(v_ptr + v_offsets, mask=key_ok[:, None], other=0.0)
    mask_desc = _mask_descriptor(mask_ptr + batch * stride_mb, q_len, k_len, stride_mq, BLOCK_Q, BLOCK_K)
    list_row = batch * tl.num_programs(1) + key_tile
    list_ptr = tiles_ptr + list_row * list_len
    full = tl.load(full_ptr + list_row)
    count = tl.load(counts_ptr + list_row)
    qk_scale = scale * 1.4426950408889634
    grad_k = tl.zeros([BLOCK_K, HEAD_DIM], tl.float32)
    grad_v = tl.zeros([BLOCK_K, HEAD_DIM], tl.float32)
    for member in range(0, groups):
        head = kv_head * groups + member
        q_base = q_ptr + batch * stride_qb + head * stride_qh
        grad_out_base = grad_out_ptr + batch * stride_ob + head * stride_oh
        lse_base = lse_ptr + (batch * num_heads + head) * q_len
        delta_base = delta_ptr + (batch * num_heads + head) * q_len
        grad_k, grad_v = _dkv_visits(
            grad_k, grad_v, k, v, q_base, grad_out_base, lse_base, delta_base, mask_desc, list_ptr, 0, full,
            key_tile * BLOCK_K, dims, q_len, stride_qs, stride_os, qk_scale, BLOCK_Q, False, PRECISION,
        )  # fmt: skip
        grad_k, grad_v = _dkv_visits(
            grad_k, grad_v, k, v, q_base, grad_out_base, lse_base, delta_base, mask_desc, list_ptr, full, count,
            key_tile * BLOCK_K, dims, q_len, stride_qs, stride_os, qk_scale, BLOCK_Q, True, PRECISION,
        )  # fmt: skip
    tl.store(grad_k_ptr + k_offsets, (grad_k * scale).to(grad_k_ptr.dtype.element_ty), mask=key_ok[:, None])
    tl.store(grad_v_ptr + v_offsets, grad_v.to(grad_v_ptr.dtype.element_ty), mask=key_ok[:, None])


# -------------------------------------------------------------------------------------------------------- host side
def _strides(q, k, v, plane, out) -> tuple:
    """q / k / v [B, heads, T, D]; the mask's plane [B, Q, K]; out (or its gradient) [B, Q, N, D]."""
    return (
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), plane.stride(0), plane.stride(1),
        out.stride(0), out.stride(2), out.stride(1),
    )  # fmt: skip


def _meta(q, block_q: int, block_k: int, warps: int, stages: int) -> dict:
    half = q.dtype in (torch.bfloat16, torch.float16)
    return dict(
        BLOCK_Q=block_q,
        BLOCK_K=block_k,
        HEAD_DIM=q.shape[3],
        PRECISION="tf32" if half else "ieee",  # fp32 inputs keep fp32 products
        num_warps=warps,
        num_stages=stages,
    )


def _forward_meta(q, sizes: TileSizes) -> dict:
    return _meta(q, sizes.query, sizes.key, sizes.forward_warps, sizes.forward_stages)


def _dq_meta(q, sizes: TileSizes) -> dict:
    return _meta(q, sizes.query, sizes.key, sizes.dq_warps, sizes.dq_stages)


def _dkv_meta(q, sizes: TileSizes) -> dict:
    return _meta(q, sizes.dkv_query, sizes.dkv_key, sizes.dkv_warps, sizes.dkv_stages)


def _descriptor_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global memory for the TMA descriptors the forward / dq programs make (128 bytes each)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_descriptor_allocator() -> None:
    """Give Triton an allocator for the descriptors' memory, unless the caller has set one (in this context)."""
    from triton.runtime import _allocation

    current = getattr(_allocation, "_allocator", None)
    null = getattr(_allocation, "NullAllocator", None)
    if current is None or null is None or isinstance(current.get(), null):
        triton.set_allocator(_descriptor_scratch)


def _tma_aligned(t: torch.Tensor) -> bool:
    """Whether TMA can read ``t`` where it lies: its last stride 1, its start and every other stride on 16 bytes.
    Asked inside the ops, and never while tracing: a traced graph knows no data pointer."""
    size = t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(stride * size % 16 == 0 for stride in t.stride()[:-1])


def _tma_readable(t: torch.Tensor) -> torch.Tensor:
    """``t`` [B, H, T, D] if TMA can read it in place, else a copy in a fresh allocation."""
    return t if _tma_aligned(t) else t.clone(memory_format=torch.contiguous_format)


def _tma_mask_plane(plane: torch.Tensor) -> torch.Tensor:
    """The mask's uint8 plane [B, Q, K] as the kernels read it: ``plane`` itself if TMA can read its rows in place
    (aligned, and rows apart), else a copy with rows padded to 16 bytes (one per batch row, or one for all where the
    mask is broadcast over the batch). While compiling or on fake tensors, always the copy."""
    batch, q_len, k_len = plane.shape
    tracing = torch.compiler.is_compiling() or is_fake(plane)
    if not tracing and plane.stride(1) >= k_len and _tma_aligned(plane):
        return plane
    source = plane[:1] if plane.stride(0) == 0 else plane
    padded = plane.new_empty(source.shape[0], q_len, -(-k_len // 16) * 16)
    padded[..., :k_len] = source
    return padded[..., :k_len].expand(batch, q_len, k_len)


def _out_like(q: torch.Tensor) -> torch.Tensor:
    """[B, Q, N, D]: what the output projection reads, flattened over the heads."""
    batch, heads, q_len, head_dim = q.shape
    return q.new_empty(batch, q_len, heads, head_dim)


@liger_custom_op("liger_dspine::masked_attention", mutates_args=())
def _masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plane: torch.Tensor,
    key_tiles: torch.Tensor,
    key_counts: torch.Tensor,
    key_full: torch.Tensor,
    key_order: torch.Tensor,
    sizes: list[int],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, Q, N, D], lse [B, N, Q] fp32); plane = AttentionTiles.plane; sizes = TileSizes."""
    batch, heads, q_len, _ = q.shape
    k, v = _tma_readable(k), _tma_readable(v)
    out = _out_like(q)
    lse = torch.empty(batch, heads, q_len, dtype=torch.float32, device=q.device)
    plane = _tma_mask_plane(plane)  # made readable by attention_tiles: a check, unless made by hand
    _ensure_descriptor_allocator()
    grid = (key_counts.shape[1], heads, batch)
    _masked_attention_forward_kernel[grid](
        q, k, v, plane, key_tiles, key_counts, key_full, key_order, out, lse,
        q_len, k.shape[2], heads, heads // k.shape[1], key_tiles.shape[2], scale,
        *_strides(q, k, v, plane, out), **_forward_meta(q, TileSizes(*sizes)),
    )  # fmt: skip
    return out, lse


@_masked_attention.register_fake
def _(q, k, v, plane, key_tiles, key_counts, key_full, key_order, sizes, scale):
    batch, heads, q_len, _ = q.shape
    return _out_like(q), q.new_empty(batch, heads, q_len, dtype=torch.float32)


def _backward_arguments(q, k, v, plane, lists, grad_out, lse, delta, *grads, scale):
    """(tensors, sizes, strides) of a backward kernel: its tile lists, counts, full counts and launch order, then
    the gradients it writes (dq for the dq kernel, dk and dv for the dk / dv kernel); plane from AttentionTiles."""
    heads = q.shape[1]
    tensors = (q, k, v, plane, *lists, grad_out, lse, delta, *grads)
    sizes = (q.shape[2], k.shape[2], heads, heads // k.shape[1], lists[0].shape[2], scale)
    return tensors, sizes, _strides(q, k, v, plane, grad_out)


@liger_custom_op("liger_dspine::masked_attention_backward", mutates_args=())
def _masked_attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plane: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    key_tiles: torch.Tensor,
    key_counts: torch.Tensor,
    key_full: torch.Tensor,
    key_order: torch.Tensor,
    query_tiles: torch.Tensor,
    query_counts: torch.Tensor,
    query_full: torch.Tensor,
    query_order: torch.Tensor,
    sizes: list[int],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq like q, dk like k, dv like v); grad_out [B, Q, N, D]; sizes = TileSizes; delta [B, N, Q] fp32."""
    sizes = TileSizes(*sizes)
    k, v = _tma_readable(k), _tma_readable(v)
    grad_q, grad_k, grad_v = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    key_lists = (key_tiles, key_counts, key_full, key_order)
    query_lists = (query_tiles, query_counts, query_full, query_order)
    plane = _tma_mask_plane(plane)
    tensors, scalars, strides = _backward_arguments(
        q, k, v, plane, key_lists, grad_out, lse, delta, grad_q, scale=scale
    )
    _ensure_descriptor_allocator()
    _masked_attention_dq_kernel[(key_counts.shape[1], q.shape[1], q.shape[0])](
        *tensors, *scalars, *strides, **_dq_meta(q, sizes)
    )
    tensors, scalars, strides = _backward_arguments(
        q, k, v, plane, query_lists, grad_out, lse, delta, grad_k, grad_v, scale=scale
    )
    _masked_attention_dkv_kernel[(k.shape[1], query_counts.shape[1], q.shape[0])](
        *tensors, *scalars, *strides, **_dkv_meta(q, sizes)
    )
    return grad_q, grad_k, grad_v


@_masked_attention_backward.register_fake
def _(grad_out, q, k, v, plane, lse, delta, key_tiles, key_counts, key_full, key_order, query_tiles, query_counts,
      query_full, query_order, sizes, scale):  # fmt: skip
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _precompile_backward(q, k, v, tiles: AttentionTiles, out, lse, scale) -> None:
    """The backward's two kernels, compiled while the forward goes on (ops/precompile.py); grad_out is laid out as
    out, delta as lse."""
    key_lists, query_lists, plane = tiles[1:5], tiles[5:9], tiles.plane
    tensors, scalars, strides = _backward_arguments(q, k, v, plane, key_lists, out, lse, lse, q, scale=scale)
    precompile(_masked_attention_dq_kernel, *tensors, *scalars, *strides, **_dq_meta(q, tiles.sizes))
    tensors, scalars, strides = _backward_arguments(q, k, v, plane, query_lists, out, lse, lse, k, v, scale=scale)
    precompile(_masked_attention_dkv_kernel, *tensors, *scalars, *strides, **_dkv_meta(q, tiles.sizes))


class LigerMaskedAttentionFunction(torch.autograd.Function):
    """``(q [B, N, Q, D], k [B, N/g, K, D], v [B, N/g, K, D], tiles, scale)`` -> [B, Q, N, D]; the mask comes as
    ``tiles.plane``."""

    kernel_ops = ("liger_dspine::masked_attention", "liger_dspine::masked_attention_backward")

    @staticmethod
    def forward(ctx, q, k, v, tiles: AttentionTiles, scale):
        sizes = list(tiles.sizes)
        out, lse = _masked_attention(q, k, v, tiles.plane, *tiles[1:5], sizes, scale)
        if q.is_cuda and any(ctx.needs_input_grad) and not torch.compiler.is_compiling():
            _precompile_backward(q, k, v, tiles, out, lse, scale)
        ctx.save_for_backward(q, k, v, tiles.plane, out, lse, *tiles[1:9])
        ctx.sizes, ctx.scale = sizes, scale
        return out

    @staticmethod
    @first_order_only
    def backward(ctx, grad_out):
        q, k, v, plane, out, lse, *lists = ctx.saved_tensors
        if grad_out.stride(3) != 1:
            grad_out = grad_out.contiguous()
        delta = (grad_out.float() * out.float()).sum(-1).transpose(1, 2).contiguous()  # [B, N, Q]
        grad_q, grad_k, grad_v = _masked_attention_backward(
            grad_out, q, k, v, plane, lse, delta, *lists, ctx.sizes, ctx.scale
        )
        return grad_q, grad_k, grad_v, None, None


def _head_dim_supported(head_dim: int) -> bool:
    """A power of two from 16 to 256."""
    return 16 <= head_dim <= 256 and not head_dim & (head_dim - 1)


def masked_attention_runs(query: torch.Tensor, key: torch.Tensor, dropout: float) -> bool:
    """Whether :func:`liger_masked_attention` takes these inputs: a device its kernels run on, no dropout, fp32 /
    bf16 / fp16, and a head width that is a power of two from 16 to 256."""
    head_dim = query.shape[-1]
    return (
        kernel_runs_on(query, _masked_attention_forward_kernel)
        and dropout == 0.0
        and query.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and _head_dim_supported(head_dim)
        and query.shape[1] % key.shape[1] == 0
    )


def liger_masked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    tiles: AttentionTiles | None = None,
) -> torch.Tensor:
    """Attention of q [B, N, Q, D] over k / v [B, N/g, K, D] (query head h reads key-value head h // g) under a
    bool mask [B or 1, 1, Q, K] (True = attend) -> [B, Q, N, D] in q's dtype. ``tiles`` (from
    :func:`attention_tiles` with ``tile_sizes(q.dtype, D, q.device)``) may be shared by calls with the same mask:
    they carry it, and the kernels read the mask from them."""
    check_kernel_device(query, "the masked attention")
    batch, heads, q_len, head_dim = query.shape
    kv_shape = (batch, key.shape[1], key.shape[2], head_dim)
    if key.dim() != 4 or tuple(key.shape) != kv_shape or tuple(value.shape) != kv_shape or heads % key.shape[1]:
        raise ValueError(
            f"liger-dspine: masked attention expects k and v [{batch}, heads dividing {heads}, K, {head_dim}], got "
            f"{tuple(key.shape)} and {tuple(value.shape)}"
        )
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise ValueError(
            f"liger-dspine: masked attention expects q, k and v in one dtype, got {query.dtype}, {key.dtype}, "
            f"{value.dtype}"
        )
    if not _head_dim_supported(head_dim):
        raise ValueError(
            f"liger-dspine: masked attention needs a head dim that is a power of two in [16, 256], got {head_dim}"
        )
    if (
        mask.dtype != torch.bool
        or mask.dim() != 4
        or mask.shape[1] != 1
        or tuple(mask.shape[2:]) != (q_len, key.shape[2])
    ):
        raise ValueError(
            f"liger-dspine: masked attention expects a bool mask [B, 1, {q_len}, {key.shape[2]}], got {mask.dtype} "
            f"{tuple(mask.shape)}"
        )
    if mask.shape[0] not in (1, batch):
        raise ValueError(f"liger-dspine: masked attention's mask batch must be 1 or {batch}, got {mask.shape[0]}")
    mask = mask.expand(batch, 1, q_len, key.shape[2])
    if mask.stride(3) != 1:
        mask = mask.contiguous()
    sizes = tile_sizes(query.dtype, head_dim, query.device)
    if tiles is None:
        tiles = attention_tiles(mask, sizes)
    elif tiles.sizes != sizes or tuple(tiles.plane.shape) != (batch, q_len, key.shape[2]):
        raise ValueError(
            f"liger-dspine: masked attention's tiles were made for {tiles.sizes} and a mask "
            f"{list(tiles.plane.shape)}, these inputs need {sizes} and [{batch}, {q_len}, {key.shape[2]}]"
        )
    query, key, value = (t if t.stride(3) == 1 else t.contiguous() for t in (query, key, value))
    return LigerMaskedAttentionFunction.apply(query, key, value, tiles, float(scale))
