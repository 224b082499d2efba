"""Attention with per-head sinks over a sliding window and compressed keys, never holding [S, T] scores.

DeepSeek-V4's attention, for batch b, head h and query i, with one key-value head (the key is the value):

    keys   the positions j of the sequence with i - W < j <= i (additive mask[b, i, j] on them, as given), then the
           C compressed entries c (additive bias[b, i, c]: 0, or -inf where query i may not see entry c)
    p      softmax over [scale q.k_j + mask, scale q.k_c + bias, sink_h]: the sink takes a share and has no value
    out    sum_j p_j kv_j + sum_c p_c kv_c

transformers' eager attention materialises the [B, N, S, S + C] scores, their softmax and copies of both (one
[1, 64, 16384, 16512] bf16 tensor is about 35 GB). These kernels stream key tiles through an online softmax that
starts from the sink (running max sink_h, running sum 1), so they keep only the output and a log-sum-exp per row.
A program takes BLOCK_Q queries of GROUP_H heads as one [BLOCK_Q * GROUP_H, D] tile: the heads share the key
tiles, which are loaded once for all of them. The sliding part visits only the key tiles of its window.

Backward, with delta = rowsum(dO * out) (the sink has no value, so it adds nothing to it):
- dq = scale * sum_t p_t (dO.kv_t - delta) kv_t, a program per query tile as in the forward;
- dkv_t = sum over heads and queries of p_t dO + scale p_t (dO.kv_t - delta) q (key and value are one tensor, so
  both gradients add up), a program per key tile and head group (and chunk of queries, for the compressed entries
  that every query may see), added up in fp32 with atomics: its sums are not bitwise deterministic;
- dsink_h = -sum_i exp(sink_h - lse_i) delta_i, in torch.
The mask and the bias get no gradient. Scores, softmax and accumulation run in fp32; the products take the
inputs' dtype, as a flash attention does.
"""

import torch
import triton
import triton.language as tl

from liger_dspine._interpreter import check_kernel_device
from liger_dspine.ops.eager_dispatch import liger_custom_op
from liger_dspine.ops.first_order import first_order_only
from liger_dspine.ops.precompile import precompile

BLOCK_Q = 16
BLOCK_N = 32
QUERY_CHUNK = 256  # queries per program of a compressed key tile's backward


@triton.jit
def _tile_scores(
    q, kv, keys, key_ok, queries, row_ok, scale, window,
    mask_ptr, stride_mq, bias_ptr, stride_bq,
    SLIDING: tl.constexpr, HAS_ADDEND: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """scale q.kv^T for a [ROWS, BLOCK_N] tile, plus the mask (sliding keys) or the bias (compressed keys); -inf
    where a row may not see a key. mask_ptr / bias_ptr point at this batch's [S, *] plane."""
    scores = tl.dot(q, tl.trans(kv), input_precision=PRECISION) * scale
    visible = row_ok[:, None] & key_ok[None, :]
    if SLIDING:
        visible = visible & (keys[None, :] <= queries[:, None]) & (keys[None, :] > queries[:, None] - window)
        if HAS_ADDEND:
            addend = tl.load(mask_ptr + queries[:, None] * stride_mq + keys[None, :], mask=visible, other=0.0)
            scores += addend.to(tl.float32)
    elif HAS_ADDEND:
        addend = tl.load(bias_ptr + queries[:, None] * stride_bq + keys[None, :], mask=visible, other=0.0)
        scores += addend.to(tl.float32)
    return tl.where(visible, scores, float("-inf"))


@triton.jit
def _tile_scores_by_key(
    q, kv, keys, key_ok, queries, row_ok, scale, window,
    mask_ptr, stride_mq, bias_ptr, stride_bq,
    SLIDING: tl.constexpr, HAS_ADDEND: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """_tile_scores transposed: [BLOCK_N, ROWS], kv as the left operand, so that q is only ever a right operand."""
    scores = tl.dot(kv, tl.trans(q), input_precision=PRECISION) * scale
    visible = key_ok[:, None] & row_ok[None, :]
    if SLIDING:
        visible = visible & (keys[:, None] <= queries[None, :]) & (keys[:, None] > queries[None, :] - window)
        if HAS_ADDEND:
            addend = tl.load(mask_ptr + queries[None, :] * stride_mq + keys[:, None], mask=visible, other=0.0)
            scores += addend.to(tl.float32)
    elif HAS_ADDEND:
        addend = tl.load(bias_ptr + queries[None, :] * stride_bq + keys[:, None], mask=visible, other=0.0)
        scores += addend.to(tl.float32)
    return tl.where(visible, scores, float("-inf"))


@triton.jit
def _online_softmax_step(scores, kv, running_max, running_sum, acc, PRECISION: tl.constexpr):
    """One key tile into the running max, sum and [ROWS, D] accumulator of the online softmax."""
    new_max = tl.maximum(running_max, tl.max(scores, axis=1))
    p = tl.exp(scores - new_max[:, None])
    alpha = tl.exp(running_max - new_max)
    running_sum = running_sum * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv, input_precision=PRECISION)
    return new_max, running_sum, acc


@triton.jit
def _grad_query_step(scores, kv, grad_out, lse, delta, PRECISION: tl.constexpr):
    """One key tile's share of dq / scale: sum_t p_t (dO.kv_t - delta) kv_t."""
    p = tl.exp(scores - lse[:, None])
    grad_scores = p * (tl.dot(grad_out, tl.trans(kv), input_precision=PRECISION) - delta[:, None])
    return tl.dot(grad_scores.to(kv.dtype), kv, input_precision=PRECISION)


# Not specialised on (a value of 1, a multiple of 16): the sizes and the mask's and bias's strides, so that one
# compilation serves every layer kind and length (CSA's bias is a slice of a [.., C + 1] tensor, HCA's is not).
_SIZES_AND_ADDEND_STRIDES = (
    "seq_len", "num_compressed", "num_heads", "window", "stride_mb", "stride_mq", "stride_bb", "stride_bq",
)  # fmt: skip


@triton.jit(do_not_specialize=_SIZES_AND_ADDEND_STRIDES)
def _sink_attention_forward_kernel(
    q_ptr, kv_ptr, mask_ptr, bias_ptr, sinks_ptr, out_ptr, lse_ptr,
    seq_len, num_compressed, num_heads, window, scale,
    stride_qb, stride_qh, stride_qs, stride_kvb, stride_kvt, stride_mb, stride_mq, stride_bb, stride_bq,
    stride_ob, stride_os, stride_oh,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_Q: tl.constexpr, GROUP_H: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    batch = tl.program_id(2).to(tl.int64)
    rows = tl.arange(0, BLOCK_Q * GROUP_H)
    queries = (tl.program_id(0) * BLOCK_Q + rows % BLOCK_Q).to(tl.int64)  # 64-bit offsets: S * N * D >= 2^31
    heads = tl.program_id(1) * GROUP_H + rows // BLOCK_Q
    row_ok = (queries < seq_len) & (heads < num_heads)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + batch * stride_qb + heads[:, None] * stride_qh + queries[:, None] * stride_qs + dims[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    kv_base = kv_ptr + batch * stride_kvb
    mask_base = mask_ptr + batch * stride_mb
    bias_base = bias_ptr + batch * stride_bb
    # the online softmax starts from the sink: running max sink_h, running sum exp(sink_h - sink_h) = 1
    running_max = tl.load(sinks_ptr + heads, mask=row_ok, other=0.0).to(tl.float32)
    running_sum = tl.full([BLOCK_Q * GROUP_H], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_H, HEAD_DIM], tl.float32)

    first = tl.program_id(0) * BLOCK_Q
    start = (tl.maximum(first - window + 1, 0) // BLOCK_N) * BLOCK_N
    for key_start in range(start, tl.minimum(first + BLOCK_Q, seq_len), BLOCK_N):
        keys = key_start + tl.arange(0, BLOCK_N)
        key_ok = keys < seq_len
        kv = tl.load(kv_base + keys[:, None] * stride_kvt + dims[None, :], mask=key_ok[:, None], other=0.0)
        scores = _tile_scores(
            q, kv, keys, key_ok, queries, row_ok, scale, window, mask_base, stride_mq, bias_base, stride_bq,
            SLIDING=True, HAS_ADDEND=HAS_MASK, PRECISION=PRECISION,
        )  # fmt: skip
        running_max, running_sum, acc = _online_softmax_step(scores, kv, running_max, running_sum, acc, PRECISION)
    for entry_start in range(0, num_compressed, BLOCK_N):
        entries = entry_start + tl.arange(0, BLOCK_N)
        entry_ok = entries < num_compressed
        kv = tl.load(
            kv_base + (seq_len + entries)[:, None] * stride_kvt + dims[None, :], mask=entry_ok[:, None], other=0.0
        )
        scores = _tile_scores(
            q, kv, entries, entry_ok, queries, row_ok, scale, window, mask_base, stride_mq, bias_base, stride_bq,
            SLIDING=False, HAS_ADDEND=HAS_BIAS, PRECISION=PRECISION,
        )  # fmt: skip
        running_max, running_sum, acc = _online_softmax_step(scores, kv, running_max, running_sum, acc, PRECISION)

    out = acc / running_sum[:, None]
    tl.store(
        out_ptr + batch * stride_ob + queries[:, None] * stride_os + heads[:, None] * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )
    lse = running_max + tl.log(running_sum)
    tl.store(lse_ptr + (batch * num_heads + heads) * seq_len + queries, lse, mask=row_ok)


@triton.jit(do_not_specialize=_SIZES_AND_ADDEND_STRIDES)
def _sink_attention_dq_kernel(
    q_ptr, kv_ptr, mask_ptr, bias_ptr, grad_out_ptr, lse_ptr, delta_ptr, grad_q_ptr,
    seq_len, num_compressed, num_heads, window, scale,
    stride_qb, stride_qh, stride_qs, stride_kvb, stride_kvt, stride_mb, stride_mq, stride_bb, stride_bq,
    stride_ob, stride_os, stride_oh,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_Q: tl.constexpr, GROUP_H: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """dq [B, N, S, D] (q's strides); grad_out has out's [B, S, N, D] strides (stride_o*)."""
    batch = tl.program_id(2).to(tl.int64)
    rows = tl.arange(0, BLOCK_Q * GROUP_H)
    queries = (tl.program_id(0) * BLOCK_Q + rows % BLOCK_Q).to(tl.int64)  # 64-bit offsets: S * N * D >= 2^31
    heads = tl.program_id(1) * GROUP_H + rows // BLOCK_Q
    row_ok = (queries < seq_len) & (heads < num_heads)
    dims = tl.arange(0, HEAD_DIM)
    q_offsets = batch * stride_qb + heads[:, None] * stride_qh + queries[:, None] * stride_qs + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_ok[:, None], other=0.0)
    grad_out = tl.load(
        grad_out_ptr + batch * stride_ob + queries[:, None] * stride_os + heads[:, None] * stride_oh + dims[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    stats = (batch * num_heads + heads) * seq_len + queries
    lse = tl.load(lse_ptr + stats, mask=row_ok, other=0.0)
    delta = tl.load(delta_ptr + stats, mask=row_ok, other=0.0)
    kv_base = kv_ptr + batch * stride_kvb
    mask_base = mask_ptr + batch * stride_mb
    bias_base = bias_ptr + batch * stride_bb
    acc = tl.zeros([BLOCK_Q * GROUP_H, HEAD_DIM], tl.float32)

    first = tl.program_id(0) * BLOCK_Q
    start = (tl.maximum(first - window + 1, 0) // BLOCK_N) * BLOCK_N
    for key_start in range(start, tl.minimum(first + BLOCK_Q, seq_len), BLOCK_N):
        keys = key_start + tl.arange(0, BLOCK_N)
        key_ok = keys < seq_len
        kv = tl.load(kv_base + keys[:, None] * stride_kvt + dims[None, :], mask=key_ok[:, None], other=0.0)
        scores = _tile_scores(
            q, kv, keys, key_ok, queries, row_ok, scale, window, mask_base, stride_mq, bias_base, stride_bq,
            SLIDING=True, HAS_ADDEND=HAS_MASK, PRECISION=PRECISION,
        )  # fmt: skip
        acc += _grad_query_step(scores, kv, grad_out, lse, delta, PRECISION)
    for entry_start in range(0, num_compressed, BLOCK_N):
        entries = entry_start + tl.arange(0, BLOCK_N)
        entry_ok = entries < num_compressed
        kv = tl.load(
            kv_base + (seq_len + entries)[:, None] * stride_kvt + dims[None, :], mask=entry_ok[:, None], other=0.0
        )
        scores = _tile_scores(
            q, kv, entries, entry_ok, queries, row_ok, scale, window, mask_base, stride_mq, bias_base, stride_bq,
            SLIDING=False, HAS_ADDEND=HAS_BIAS, PRECISION=PRECISION,
        )  # fmt: skip
        acc += _grad_query_step(scores, kv, grad_out, lse, delta, PRECISION)
    tl.store(grad_q_ptr + q_offsets, (acc * scale).to(grad_q_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit(do_not_specialize=_SIZES_AND_ADDEND_STRIDES)
def _sink_attention_dkv_kernel(
    q_ptr, kv_ptr, mask_ptr, bias_ptr, grad_out_ptr, lse_ptr, delta_ptr, grad_kv_ptr,
    seq_len, num_compressed, num_heads, window, scale,
    stride_qb, stride_qh, stride_qs, stride_kvb, stride_kvt, stride_mb, stride_mq, stride_bb, stride_bq,
    stride_ob, stride_os, stride_oh,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_Q: tl.constexpr, GROUP_H: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    QUERY_CHUNK: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Adds into dkv [B, S + C, D] fp32 (contiguous, zeroed) the share of every head in one key tile (program_id
    0): a sliding tile with the queries that see it, or a compressed tile with one chunk of QUERY_CHUNK queries
    (every query may see a compressed entry, so those tiles are split along the queries). The heads are a loop, not
    a grid axis: the one key-value head is shared by all of them, and a grid axis would add each element once per
    head group (32 at V4's 64 heads), atomics that serialised into most of the backward's time."""
    batch = tl.program_id(2).to(tl.int64)
    tile = tl.program_id(0)
    sliding_tiles = tl.cdiv(seq_len, BLOCK_N)
    sliding = tile < sliding_tiles
    if sliding:
        keys = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        key_ok = keys < seq_len
        rows_of_kv = keys
        query_start = ((tile * BLOCK_N) // BLOCK_Q) * BLOCK_Q  # the queries that can see these keys
        query_end = tl.minimum(tile * BLOCK_N + BLOCK_N + window - 1, seq_len)
    else:
        chunks = tl.cdiv(seq_len, QUERY_CHUNK)
        keys = ((tile - sliding_tiles) // chunks) * BLOCK_N + tl.arange(0, BLOCK_N)
        key_ok = keys < num_compressed
        rows_of_kv = seq_len + keys
        query_start = ((tile - sliding_tiles) % chunks) * QUERY_CHUNK
        query_end = tl.minimum(query_start + QUERY_CHUNK, seq_len)
    dims = tl.arange(0, HEAD_DIM)
    kv = tl.load(
        kv_ptr + batch * stride_kvb + rows_of_kv[:, None] * stride_kvt + dims[None, :], mask=key_ok[:, None], other=0.0
    )
    mask_base = mask_ptr + batch * stride_mb
    bias_base = bias_ptr + batch * stride_bb
    acc = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    rows = tl.arange(0, BLOCK_Q * GROUP_H)
    for group_start in range(0, num_heads, GROUP_H):  # every head here: one add per element and query chunk
        heads = group_start + rows // BLOCK_Q
        for block_start in range(query_start, query_end, BLOCK_Q):
            queries = (block_start + rows % BLOCK_Q).to(tl.int64)
            row_ok = (queries < query_end) & (heads < num_heads)
            q = tl.load(
                q_ptr + batch * stride_qb + heads[:, None] * stride_qh + queries[:, None] * stride_qs + dims[None, :],
                mask=row_ok[:, None],
                other=0.0,
            )
            grad_out = tl.load(
                grad_out_ptr
                + batch * stride_ob
                + queries[:, None] * stride_os
                + heads[:, None] * stride_oh
                + dims[None, :],
                mask=row_ok[:, None],
                other=0.0,
            )
            stats = (batch * num_heads + heads) * seq_len + queries
            lse = tl.load(lse_ptr + stats, mask=row_ok, other=0.0)
            delta = tl.load(delta_ptr + stats, mask=row_ok, other=0.0)
            if sliding:
                scores = _tile_scores_by_key(
                    q, kv, keys, key_ok, queries, row_ok, scale, window, mask_base, stride_mq, bias_base, stride_bq,
                    SLIDING=True, HAS_ADDEND=HAS_MASK, PRECISION=PRECISION,
                )  # fmt: skip
            else:
                scores = _tile_scores_by_key(
                    q, kv, keys, key_ok, queries, row_ok, scale, window, mask_base, stride_mq, bias_base, stride_bq,
                    SLIDING=False, HAS_ADDEND=HAS_BIAS, PRECISION=PRECISION,
                )  # fmt: skip
            # [keys, rows] throughout: q and grad_out are right operands only (as kv is in the dq kernel)
            p = tl.exp(scores - lse[None, :])
            grad_p = tl.dot(kv, tl.trans(grad_out), input_precision=PRECISION)
            grad_scores = p * (grad_p - delta[None, :]) * scale
            acc += tl.dot(p.to(q.dtype), grad_out, input_precision=PRECISION)
            acc += tl.dot(grad_scores.to(q.dtype), q, input_precision=PRECISION)
    out = grad_kv_ptr + (batch * (seq_len + num_compressed) + rows_of_kv[:, None]) * HEAD_DIM + dims[None, :]
    tl.atomic_add(out, acc, mask=key_ok[:, None])


# ------------------------------------------------------------------------------------------------------ host side
def _group_heads(num_heads: int, head_dim: int) -> int:
    """Heads per program, a power of two: up to 4, and at most 16384 / (BLOCK_Q * D) so that the fp32 accumulator
    [BLOCK_Q * heads, D] stays within 64 KiB (2 heads at V4's D = 512)."""
    return max(1, min(4, triton.next_power_of_2(num_heads), 16384 // (BLOCK_Q * head_dim)))


def _launch_arguments(q, kv, mask, bias, seq_len, window, scale):
    num_heads = q.shape[1]
    mask_view = mask[:, 0] if mask is not None else None
    bias_view = bias[:, 0] if bias is not None else None
    dummy = q.new_empty(1)
    return (
        mask_view if mask_view is not None else dummy,
        bias_view if bias_view is not None else dummy,
        (seq_len, kv.shape[1] - seq_len, num_heads, window, scale),
        (
            q.stride(0),
            q.stride(1),
            q.stride(2),
            kv.stride(0),
            kv.stride(1),
            mask_view.stride(0) if mask_view is not None else 0,
            mask_view.stride(1) if mask_view is not None else 0,
            bias_view.stride(0) if bias_view is not None else 0,
            bias_view.stride(1) if bias_view is not None else 0,
        ),  # fmt: skip
        dict(
            HAS_MASK=mask is not None,
            # without compressed entries the bias is never read: one compilation for both kinds of layer
            HAS_BIAS=bias is not None or kv.shape[1] == seq_len,
            BLOCK_Q=BLOCK_Q,
            GROUP_H=_group_heads(num_heads, q.shape[3]),
            # fp32 inputs keep fp32 products (Triton's default for them on a GPU is TF32)
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            num_warps=8 if q.shape[3] >= 256 else 4,
            # wide heads: two stages of the looped [BLOCK, D] tiles keep the shared memory within an H100 / H200's
            num_stages=2 if q.shape[3] >= 256 else 3,
        ),
    )


@liger_custom_op("liger_dspine::sink_attention", mutates_args=())
def _sink_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    sinks: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    window: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, S, N, D], lse [B, N, S] fp32)."""
    batch, num_heads, seq_len, head_dim = q.shape
    out = q.new_empty(batch, seq_len, num_heads, head_dim)
    lse = torch.empty(batch, num_heads, seq_len, dtype=torch.float32, device=q.device)
    mask_arg, bias_arg, sizes, strides, flags = _launch_arguments(q, kv, mask, bias, seq_len, window, scale)
    grid = (triton.cdiv(seq_len, BLOCK_Q), triton.cdiv(num_heads, flags["GROUP_H"]), batch)
    _sink_attention_forward_kernel[grid](
        q, kv, mask_arg, bias_arg, sinks, out, lse, *sizes, *strides, out.stride(0), out.stride(1), out.stride(2),
        **flags, BLOCK_N=BLOCK_N, HEAD_DIM=head_dim,
    )  # fmt: skip
    return out, lse


@_sink_attention.register_fake
def _(q, kv, sinks, mask, bias, window, scale):
    batch, num_heads, seq_len, head_dim = q.shape
    return (
        q.new_empty(batch, seq_len, num_heads, head_dim),
        q.new_empty(batch, num_heads, seq_len, dtype=torch.float32),
    )


@liger_custom_op("liger_dspine::sink_attention_backward", mutates_args=())
def _sink_attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    kv: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    lse: torch.Tensor,
    delta: torch.Tensor,
    window: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq like q, dkv like kv); grad_out [B, S, N, D] contiguous, delta [B, N, S] fp32."""
    batch, num_heads, seq_len, head_dim = q.shape
    grad_q = torch.empty_like(q)
    grad_kv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)  # head groups add into it
    mask_arg, bias_arg, sizes, strides, flags = _launch_arguments(q, kv, mask, bias, seq_len, window, scale)
    out_strides = (grad_out.stride(0), grad_out.stride(1), grad_out.stride(2))
    grid = (triton.cdiv(seq_len, BLOCK_Q), triton.cdiv(num_heads, flags["GROUP_H"]), batch)
    _sink_attention_dq_kernel[grid](
        q, kv, mask_arg, bias_arg, grad_out, lse, delta, grad_q, *sizes, *strides, *out_strides,
        **flags, BLOCK_N=BLOCK_N, HEAD_DIM=head_dim,
    )  # fmt: skip
    key_tiles = triton.cdiv(seq_len, BLOCK_N)
    key_tiles += triton.cdiv(kv.shape[1] - seq_len, BLOCK_N) * triton.cdiv(seq_len, QUERY_CHUNK)
    _sink_attention_dkv_kernel[(key_tiles, 1, batch)](
        q, kv, mask_arg, bias_arg, grad_out, lse, delta, grad_kv, *sizes, *strides, *out_strides,
        **flags, BLOCK_N=BLOCK_N, HEAD_DIM=head_dim, QUERY_CHUNK=QUERY_CHUNK,
    )  # fmt: skip
    return grad_q, grad_kv.to(kv.dtype)


def _precompile_backward(q, kv, mask, bias, out, lse, window, scale) -> None:
    """The backward's two kernels, compiled while the forward goes on (ops/precompile.py)."""
    mask_arg, bias_arg, sizes, strides, flags = _launch_arguments(q, kv, mask, bias, q.shape[2], window, scale)
    tensors = (q, kv, mask_arg, bias_arg, out, lse, lse)  # grad_out is laid out as out, delta as lse
    common = (*sizes, *strides, out.stride(0), out.stride(1), out.stride(2))
    meta = dict(flags, BLOCK_N=BLOCK_N, HEAD_DIM=q.shape[3])
    precompile(_sink_attention_dq_kernel, *tensors, q, *common, **meta)
    precompile(_sink_attention_dkv_kernel, *tensors, lse, *common, **meta, QUERY_CHUNK=QUERY_CHUNK)  # fp32 dkv


@_sink_attention_backward.register_fake
def _(grad_out, q, kv, mask, bias, lse, delta, window, scale):
    return torch.empty_like(q), torch.empty_like(kv)


class LigerSinkAttentionFunction(torch.autograd.Function):
    """``(q [B, N, S, D], kv [B, S + C, D], sinks [N], mask, bias, window, scale)`` -> out [B, S, N, D]."""

    kernel_ops = ("liger_dspine::sink_attention", "liger_dspine::sink_attention_backward")

    @staticmethod
    def forward(ctx, q, kv, sinks, mask, bias, window, scale):
        out, lse = _sink_attention(q, kv, sinks.float(), mask, bias, window, scale)
        if q.is_cuda and any(ctx.needs_input_grad) and not torch.compiler.is_compiling():
            _precompile_backward(q, kv, mask, bias, out, lse, window, scale)
        ctx.save_for_backward(q, kv, sinks, mask, bias, out, lse)
        ctx.window, ctx.scale = window, scale
        return out

    @staticmethod
    @first_order_only
    def backward(ctx, grad_out):
        q, kv, sinks, mask, bias, out, lse = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        delta = (grad_out.float() * out.float()).sum(-1).transpose(1, 2).contiguous()  # [B, N, S]
        grad_q, grad_kv = _sink_attention_backward(grad_out, q, kv, mask, bias, lse, delta, ctx.window, ctx.scale)
        grad_sinks = None
        if ctx.needs_input_grad[2]:
            share = torch.exp(sinks.float()[None, :, None] - lse)  # the sink's probability per row
            grad_sinks = -(share * delta).sum((0, 2)).to(sinks.dtype)
        return grad_q, grad_kv, grad_sinks, None, None, None, None


def liger_sink_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    sinks: torch.Tensor,
    window: int,
    scale: float,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q [B, N, S, D] over kv [B, S + C, D] (S sequence positions, then C compressed entries; key and
    value are one tensor) with per-head sinks [N], a sliding window of ``window`` positions (i - window < j <= i),
    an optional additive ``mask`` [B, 1, S, >= S] read on the window (columns beyond S are not read) and an optional
    additive ``bias`` [B, 1, S, C] on the compressed entries. Returns [B, S, N, D] in q's dtype.

    The sequence positions must be 0..S-1 (no cache): the window is taken on indices. D must be a power of two,
    at least 16.
    """
    check_kernel_device(q, "the sink attention")
    batch, num_heads, seq_len, head_dim = q.shape
    compressed = kv.shape[1] - seq_len if kv.dim() == 3 else -1
    if kv.dim() != 3 or kv.shape[0] != batch or kv.shape[2] != head_dim or compressed < 0:
        raise ValueError(
            f"liger-dspine: sink attention expects kv [B, S + C, D] = [{batch}, >= {seq_len}, {head_dim}], got "
            f"{tuple(kv.shape)}"
        )
    if kv.dtype != q.dtype:
        raise ValueError(f"liger-dspine: sink attention expects q and kv in one dtype, got {q.dtype} and {kv.dtype}")
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"liger-dspine: sink attention needs a head dim that is a power of two >= 16, got {head_dim}")
    if tuple(sinks.shape) != (num_heads,):
        raise ValueError(f"liger-dspine: sink attention expects sinks [{num_heads}], got {tuple(sinks.shape)}")
    if window < 1:
        raise ValueError(f"liger-dspine: sink attention needs a window >= 1, got {window}")
    if mask is not None and (
        mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != seq_len or mask.shape[3] < seq_len
    ):
        raise ValueError(
            f"liger-dspine: sink attention expects a mask [B, 1, {seq_len}, >= {seq_len}], got {tuple(mask.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (batch, 1, seq_len, compressed):
        raise ValueError(
            f"liger-dspine: sink attention expects a bias [{batch}, 1, {seq_len}, {compressed}], got "
            f"{tuple(bias.shape)}"
        )
    if mask is not None:
        mask = mask.expand(batch, 1, seq_len, mask.shape[3])
        if mask.stride(3) != 1:
            mask = mask.contiguous()
    if bias is not None and bias.stride(3) != 1:
        bias = bias.contiguous()
    q = q if q.stride(3) == 1 else q.contiguous()
    kv = kv if kv.stride(2) == 1 else kv.contiguous()
    return LigerSinkAttentionFunction.apply(q, kv, sinks, mask, bias, int(window), float(scale))
