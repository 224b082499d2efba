"""DeepSeek-V3 interleaved partial RoPE in Triton, fused with MLA's query and key assembly.

DeepSeek stores the rotary dimensions of a head as pairs ``(x0, x1), (x2, x3), ...``; pair ``j`` turns by the
angle of frequency ``j``. transformers' ``apply_rotary_pos_emb_interleave`` writes the result de-interleaved
(R = rope width, C = R / 2):

    out[..., j]     = x[..., 2j] * cos[..., j] - x[..., 2j + 1] * sin[..., j]        j < C
    out[..., C + j] = x[..., 2j + 1] * cos[..., j] + x[..., 2j] * sin[..., j]

Other layouts of the family (``layout``, the rows' arrangement before -> after the turn):

- "interleaved": pairs -> split halves, as above (DeepSeek-V3 and its copies, Mistral-Small-4 with rope_interleave);
- "pairs": pairs -> pairs, each pair turned in place (DeepSeek-V2's complex form, ``view_as_complex(x) * freqs_cis``);
- "halves": split halves -> split halves, pair ``j`` being ``(x[j], x[C + j])`` (``rotate_half``: MiniCPM3,
  Mistral-Small-4 without rope_interleave).

``cos``/``sin`` are ``[B or 1, S, >= C]``, of which the first C columns are read (transformers' ``cat(freqs, freqs)``
layout, or DeepSeek-V2's ``freqs_cis.real`` / ``.imag``). They get no gradient (transformers derives them from a
buffer). Products and sums run in fp32; results are stored in the input dtype.

Three entry points, each one ``torch.autograd.Function`` built on one kernel:

- :func:`liger_interleaved_rope` (and :func:`liger_interleaved_rope_single`): transformers' function as is.
- :func:`liger_mla_query`: ``q_states [B, H, S, nope + R]`` (usually a transposed view of the projection) to the
  query ``[B, H, S, nope + R]`` with the rope part turned: replaces the split, the RoPE and
  ``torch.cat((q_pass, q_rot))``. The backward writes the gradient of ``q_states`` in one pass.
- :func:`liger_mla_key`: ``kv [B, H, S, nope + V]`` (the ``kv_b_proj`` output viewed per head) and the shared
  ``k_rot [B, 1, S, R]`` to the key ``[B, H, S, nope + R]`` (rotating ``k_rot`` on the way, or not when it comes
  out of a cache already turned) and a copy of the value ``kv[..., nope:]``, so that the ``kv_b_proj`` output is
  freed instead of living until the attention backward through a value view. The backward writes the gradient of
  ``kv`` (key and value parts) in one pass and sums the rope gradient over heads.

The query, key and value are ``[B, H, S, D]`` views of ``[B, S, H, D]`` memory: flash and cuDNN attention then
give their output in ``[B, S, H, D]`` memory, which ``o_proj`` reads as ``[B, S, H * D]`` without a copy and
without a second saved tensor.
"""

import torch
import triton
import triton.language as tl

from liger_dspine._interpreter import check_kernel_device
from liger_dspine.ops.eager_dispatch import liger_custom_op
from liger_dspine.ops.first_order import first_order_only

_TILE = 4096  # elements of the widest [heads, columns] tile a program handles per step
_NUM_WARPS = 4
_MAX_BLOCK_H = 32

# How rope rows map to heads: one per head, one source row broadcast to every head, every head summed into one.
_ROT_PER_HEAD = 0
_ROT_BROADCAST = 1
_ROT_REDUCE = 2

# layout -> (source rows hold pairs, turned rows hold pairs); the backward turns back from the second to the first
LAYOUTS = {"interleaved": (True, False), "pairs": (True, True), "halves": (False, False)}


@triton.jit
def _rope_rows_kernel(
    pass_src,  # [B, H, S, NOPE] copied unchanged to pass_dst
    pass_dst,
    extra_src,  # [B, H, S, EXTRA] copied unchanged to extra_dst (the value gradient in the key backward)
    extra_dst,
    rot_src,  # [B, H or 1, S, 2 * HALF]
    rot_dst,  # [B, H or 1, S, 2 * HALF]
    cos_ptr,  # [B, S, >= HALF]: the first HALF columns are read
    sin_ptr,
    seq_len,
    num_heads,
    ps_b,
    ps_h,
    ps_s,
    pd_b,
    pd_h,
    pd_s,
    es_b,
    es_h,
    es_s,
    ed_b,
    ed_h,
    ed_s,
    rs_b,
    rs_h,
    rs_s,
    rd_b,
    rd_h,
    rd_s,
    cos_b,
    cos_s,
    sin_b,
    sin_s,
    NOPE: tl.constexpr,
    EXTRA: tl.constexpr,
    HALF: tl.constexpr,
    ROTATE: tl.constexpr,  # False: plain copy of split-layout rows (keys read back from a cache)
    INVERSE: tl.constexpr,  # backward: turn by -angle
    SRC_PAIRS: tl.constexpr,  # source rows hold interleaved pairs (x0, x1), (x2, x3), ... (else split halves)
    DST_PAIRS: tl.constexpr,  # destination rows get interleaved pairs (the backward of a turn)
    ROT_MODE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    BLOCK_NOPE: tl.constexpr,
    BLOCK_EXTRA: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """One program per (batch, position) row and group of HEADS_PER_PROGRAM heads, walked BLOCK_H at a time (the
    head-reducing mode takes every head in one program). All last strides are 1."""
    row = tl.program_id(0).to(tl.int64)
    head_start = tl.program_id(1) * HEADS_PER_PROGRAM
    head_end = tl.minimum(head_start + HEADS_PER_PROGRAM, num_heads)
    b = row // seq_len
    s = row % seq_len
    heads = tl.arange(0, BLOCK_H)
    cols_j = tl.arange(0, BLOCK_HALF)
    mask_j = cols_j < HALF

    # Column of pair j's first and second member in the source and destination rows.
    if SRC_PAIRS:
        src_a = 2 * cols_j
        src_b = 2 * cols_j + 1
    else:
        src_a = cols_j
        src_b = cols_j + HALF
    if DST_PAIRS:
        dst_a = 2 * cols_j
        dst_b = 2 * cols_j + 1
    else:
        dst_a = cols_j
        dst_b = cols_j + HALF

    if ROTATE:
        c = tl.load(cos_ptr + b * cos_b + s * cos_s + cols_j, mask=mask_j, other=0.0).to(tl.float32)
        sn = tl.load(sin_ptr + b * sin_b + s * sin_s + cols_j, mask=mask_j, other=0.0).to(tl.float32)
        if INVERSE:
            sn = -sn

    rot_src_row = rot_src + b * rs_b + s * rs_s
    rot_dst_row = rot_dst + b * rd_b + s * rd_s
    if ROT_MODE == 1:
        # One shared source row, turned once and written to every head.
        xa = tl.load(rot_src_row + src_a, mask=mask_j, other=0.0).to(tl.float32)
        xb = tl.load(rot_src_row + src_b, mask=mask_j, other=0.0).to(tl.float32)
        if ROTATE:
            shared_a = xa * c - xb * sn
            shared_b = xb * c + xa * sn
        else:
            shared_a = xa
            shared_b = xb
    if ROT_MODE == 2:
        sum_a = tl.zeros((BLOCK_HALF,), dtype=tl.float32)
        sum_b = tl.zeros((BLOCK_HALF,), dtype=tl.float32)

    for h0 in range(head_start, head_end, BLOCK_H):
        h = (h0 + heads).to(tl.int64)
        mask_h = h < head_end
        if NOPE > 0:
            cols_n = tl.arange(0, BLOCK_NOPE)
            mask_n = mask_h[:, None] & (cols_n < NOPE)[None, :]
            x = tl.load(pass_src + b * ps_b + s * ps_s + h[:, None] * ps_h + cols_n[None, :], mask=mask_n)
            tl.store(pass_dst + b * pd_b + s * pd_s + h[:, None] * pd_h + cols_n[None, :], x, mask=mask_n)
        if EXTRA > 0:
            cols_e = tl.arange(0, BLOCK_EXTRA)
            mask_e = mask_h[:, None] & (cols_e < EXTRA)[None, :]
            x = tl.load(extra_src + b * es_b + s * es_s + h[:, None] * es_h + cols_e[None, :], mask=mask_e)
            tl.store(extra_dst + b * ed_b + s * ed_s + h[:, None] * ed_h + cols_e[None, :], x, mask=mask_e)

        mask_hj = mask_h[:, None] & mask_j[None, :]
        dst_heads = rot_dst_row + h[:, None] * rd_h
        if ROT_MODE == 1:
            zero = tl.zeros((BLOCK_H, BLOCK_HALF), dtype=tl.float32)
            tl.store(dst_heads + dst_a[None, :], zero + shared_a[None, :], mask=mask_hj)
            tl.store(dst_heads + dst_b[None, :], zero + shared_b[None, :], mask=mask_hj)
        else:
            src_heads = rot_src_row + h[:, None] * rs_h
            xa = tl.load(src_heads + src_a[None, :], mask=mask_hj, other=0.0).to(tl.float32)
            xb = tl.load(src_heads + src_b[None, :], mask=mask_hj, other=0.0).to(tl.float32)
            if ROT_MODE == 2:
                sum_a += tl.sum(xa, axis=0)
                sum_b += tl.sum(xb, axis=0)
            else:
                if ROTATE:
                    ya = xa * c[None, :] - xb * sn[None, :]
                    yb = xb * c[None, :] + xa * sn[None, :]
                else:
                    ya = xa
                    yb = xb
                tl.store(dst_heads + dst_a[None, :], ya, mask=mask_hj)
                tl.store(dst_heads + dst_b[None, :], yb, mask=mask_hj)

    if ROT_MODE == 2:
        if ROTATE:
            ya = sum_a * c - sum_b * sn
            yb = sum_b * c + sum_a * sn
        else:
            ya = sum_a
            yb = sum_b
        tl.store(rot_dst_row + dst_a, ya, mask=mask_j)
        tl.store(rot_dst_row + dst_b, yb, mask=mask_j)


def _last_dim_unit(x: torch.Tensor) -> torch.Tensor:
    """The kernel addresses columns with stride 1; other layouts (rare) are copied once."""
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


def _row_strides(x: torch.Tensor | None) -> tuple[int, int, int]:
    """(batch, head, position) strides of a [B, H, S, D] tensor; a broadcast dimension of size 1 gets 0."""
    if x is None:
        return 0, 0, 0
    return tuple(0 if x.shape[i] == 1 else x.stride(i) for i in range(3))


def _angles(t: torch.Tensor, batch: int, seq_len: int, half: int) -> torch.Tensor:
    """cos or sin as [B or 1, S, >= half] with a unit last stride."""
    if t.dim() == 2:
        t = t.unsqueeze(0)
    if t.dim() != 3 or t.shape[0] not in (1, batch) or t.shape[1] != seq_len or t.shape[2] < half:
        raise ValueError(
            f"liger-dspine: cos/sin must be [B or 1, S, >= {half}] with B={batch}, S={seq_len}; got {tuple(t.shape)}"
        )
    return _last_dim_unit(t[..., :half])


def _angle_strides(t: torch.Tensor | None) -> tuple[int, int]:
    if t is None:
        return 0, 0
    return (0 if t.shape[0] == 1 else t.stride(0)), t.stride(1)


def _next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def _launch(
    *,
    batch: int,
    seq_len: int,
    num_heads: int,
    rot_src: torch.Tensor,
    rot_dst: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    inverse: bool,
    rot_mode: int,
    layout: str = "interleaved",
    pass_src: torch.Tensor | None = None,
    pass_dst: torch.Tensor | None = None,
    extra_src: torch.Tensor | None = None,
    extra_dst: torch.Tensor | None = None,
) -> None:
    """Run the kernel over B * S rows. Tensors are [B, H, S, D] (rope tensors [B, 1, S, R] in the shared modes)."""
    check_kernel_device(rot_src, "interleaved RoPE")
    if batch * seq_len == 0 or num_heads == 0:
        return
    nope = pass_src.shape[-1] if pass_src is not None else 0
    extra = extra_src.shape[-1] if extra_src is not None else 0
    half = rot_src.shape[-1] // 2
    widest = max(_next_pow2(nope), _next_pow2(extra), _next_pow2(half))
    # at most _MAX_BLOCK_H heads a step: a [128, 32] tile of a narrow rope slice ran 8x slower per byte on an H200
    block_h = min(_next_pow2(num_heads), max(1, _TILE // widest), _MAX_BLOCK_H)
    # Several programs per row (one tile of heads each) keep more loads in flight; a head sum needs one program.
    heads_per_program = _next_pow2(num_heads) if rot_mode == _ROT_REDUCE else block_h
    grid = (batch * seq_len, triton.cdiv(num_heads, heads_per_program))
    # Unused pointers point at rot_src; the kernel never reads them (constexpr branches).
    _rope_rows_kernel[grid](
        pass_src if pass_src is not None else rot_src,
        pass_dst if pass_dst is not None else rot_src,
        extra_src if extra_src is not None else rot_src,
        extra_dst if extra_dst is not None else rot_src,
        rot_src,
        rot_dst,
        cos if cos is not None else rot_src,
        sin if sin is not None else rot_src,
        seq_len,
        num_heads,
        *_row_strides(pass_src),
        *_row_strides(pass_dst),
        *_row_strides(extra_src),
        *_row_strides(extra_dst),
        *_row_strides(rot_src),
        *_row_strides(rot_dst),
        *_angle_strides(cos),
        *_angle_strides(sin),
        NOPE=nope,
        EXTRA=extra,
        HALF=half,
        ROTATE=cos is not None,
        INVERSE=inverse,
        SRC_PAIRS=cos is not None and LAYOUTS[layout][inverse],
        DST_PAIRS=cos is not None and LAYOUTS[layout][not inverse],
        ROT_MODE=rot_mode,
        BLOCK_H=block_h,
        HEADS_PER_PROGRAM=heads_per_program,
        BLOCK_NOPE=_next_pow2(nope),
        BLOCK_EXTRA=_next_pow2(extra),
        BLOCK_HALF=_next_pow2(half),
        num_warps=_NUM_WARPS,
        # Separate products and sums, as torch's eager kernels: fp32 results equal transformers' bit for bit.
        enable_fp_fusion=False,
    )


def _heads_layout(batch: int, heads: int, seq_len: int, width: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape and strides of a [B, H, S, D] tensor stored position-major ([B, S, H, D] memory), the layout attention
    kernels keep for their output: the attention output then reshapes to [B, S, H * D] for ``o_proj`` without a
    copy. Allocated with ``empty_strided``, so the tensor is not a view of another."""
    return (batch, heads, seq_len, width), (seq_len * heads * width, width, heads * width, 1)


def _empty_layout(shape, strides, like: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(tuple(shape), tuple(strides), dtype=like.dtype, device=like.device)


def _dense_layout(x: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape and strides a gradient of ``x`` should have: x's own when x is dense (a transposed view of a
    projection), so the gradient reaches the projection without a copy; contiguous otherwise."""
    meta = torch.empty_like(x, device="meta")
    return tuple(meta.shape), tuple(meta.stride())


def _check_rope_width(width: int) -> None:
    if width % 2 or width == 0:
        raise ValueError(f"liger-dspine: the rope width must be even and positive, got {width}")


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"liger-dspine: the rope layout must be one of {', '.join(LAYOUTS)}; got {layout!r}")


def _check_constant_angles(cos: torch.Tensor, sin: torch.Tensor) -> None:
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise NotImplementedError("liger-dspine: interleaved RoPE gives no gradient to cos/sin; detach them first")


# The kernel launches as torch custom ops: opaque to torch.compile, with fake implementations that give the outputs'
# shapes and strides without launching anything. Each output is a new tensor (empty_strided, not a view).


@liger_custom_op("liger_dspine::rope_rotate", mutates_args=())
def _rope_rotate(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    nope: int,
    inverse: bool,
    out_shape: list[int],
    out_strides: list[int],
    layout: str,
) -> torch.Tensor:
    """x [B, H, S, nope + R] -> a new tensor of the given memory layout: the first ``nope`` columns copied, the last
    R turned in the rope ``layout`` (by -angle with ``inverse``, from its turned arrangement back to its source's)."""
    out = _empty_layout(out_shape, out_strides, x)
    batch, heads, seq_len, _ = x.shape
    _launch(
        batch=batch,
        seq_len=seq_len,
        num_heads=heads,
        pass_src=x[..., :nope] if nope else None,
        pass_dst=out[..., :nope] if nope else None,
        rot_src=x[..., nope:],
        rot_dst=out[..., nope:],
        cos=cos,
        sin=sin,
        inverse=inverse,
        rot_mode=_ROT_PER_HEAD,
        layout=layout,
    )
    return out


@_rope_rotate.register_fake
def _(x, cos, sin, nope, inverse, out_shape, out_strides, layout):
    return _empty_layout(out_shape, out_strides, x)


@liger_custom_op("liger_dspine::rope_unrotate_", mutates_args=("x",))
def _rope_unrotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, nope: int, layout: str) -> None:
    """Turn the last R columns of x [B, H, S, nope + R] back by -angle, in place, through a buffer of their size."""
    batch, heads, seq_len, _ = x.shape
    rope = x[..., nope:]
    turned = _empty_layout(*_heads_layout(batch, heads, seq_len, rope.shape[-1]), rope)  # rope's position-major order
    _launch(
        batch=batch,
        seq_len=seq_len,
        num_heads=heads,
        rot_src=rope,
        rot_dst=turned,
        cos=cos,
        sin=sin,
        inverse=True,
        rot_mode=_ROT_PER_HEAD,
        layout=layout,
    )
    rope.copy_(turned)


@_rope_unrotate_.register_fake
def _(x, cos, sin, nope, layout):
    return None


@liger_custom_op("liger_dspine::mla_key", mutates_args=())
def _mla_key(
    kv: torch.Tensor, k_rot: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, nope: int, layout: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """kv [B, H, S, nope + V], k_rot [B, 1, S, R] -> new key [B, H, S, nope + R] and value [B, H, S, V], both
    position-major."""
    key, value = _mla_key_fake(kv, k_rot, cos, sin, nope, layout)
    batch, heads, seq_len, _ = kv.shape
    _launch(
        batch=batch,
        seq_len=seq_len,
        num_heads=heads,
        pass_src=kv[..., :nope],
        pass_dst=key[..., :nope],
        extra_src=kv[..., nope:],
        extra_dst=value,
        rot_src=k_rot,
        rot_dst=key[..., nope:],
        cos=cos,
        sin=sin,
        inverse=False,
        rot_mode=_ROT_BROADCAST,
        layout=layout,
    )
    return key, value


@_mla_key.register_fake
def _mla_key_fake(kv, k_rot, cos, sin, nope, layout):
    batch, heads, seq_len, width = kv.shape
    key = _empty_layout(*_heads_layout(batch, heads, seq_len, nope + k_rot.shape[-1]), kv)
    value = _empty_layout(*_heads_layout(batch, heads, seq_len, width - nope), kv)
    return key, value


@liger_custom_op("liger_dspine::mla_key_backward", mutates_args=())
def _mla_key_backward(
    grad_key: torch.Tensor,
    grad_value: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    nope: int,
    kv_shape: list[int],
    kv_strides: list[int],
    k_rot_shape: list[int],
    k_rot_strides: list[int],
    layout: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of kv (key and value parts) and of k_rot (summed over heads), in the given layouts."""
    grad_kv, grad_k_rot = _mla_key_backward_fake(
        grad_key, grad_value, cos, sin, nope, kv_shape, kv_strides, k_rot_shape, k_rot_strides, layout
    )
    batch, heads, seq_len, _ = grad_key.shape
    _launch(
        batch=batch,
        seq_len=seq_len,
        num_heads=heads,
        pass_src=grad_key[..., :nope],
        pass_dst=grad_kv[..., :nope],
        extra_src=grad_value,
        extra_dst=grad_kv[..., nope:],
        rot_src=grad_key[..., nope:],
        rot_dst=grad_k_rot,
        cos=cos,
        sin=sin,
        inverse=True,
        rot_mode=_ROT_REDUCE,
        layout=layout,
    )
    return grad_kv, grad_k_rot


@_mla_key_backward.register_fake
def _mla_key_backward_fake(
    grad_key, grad_value, cos, sin, nope, kv_shape, kv_strides, k_rot_shape, k_rot_strides, layout
):
    return _empty_layout(kv_shape, kv_strides, grad_key), _empty_layout(k_rot_shape, k_rot_strides, grad_key)


class LigerInterleavedRopeFunction(torch.autograd.Function):
    """x [B, H, S, R] -> turned x [B, H, S, R] (contiguous), by default the layout of transformers' interleaved
    RoPE (``layout``: see the module docstring)."""

    kernel_ops = ("liger_dspine::rope_rotate",)

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str = "interleaved"):
        batch, heads, seq_len, width = x.shape
        _check_rope_width(width)
        x = _last_dim_unit(x)
        cos = _angles(cos, batch, seq_len, width // 2)
        sin = _angles(sin, batch, seq_len, width // 2)
        contiguous = (heads * seq_len * width, seq_len * width, width, 1)
        out = _rope_rotate(x, cos, sin, 0, False, list(x.shape), list(contiguous), layout)
        ctx.save_for_backward(cos, sin)
        ctx.grad_layout = _dense_layout(x)
        ctx.layout = layout
        return out

    @staticmethod
    @first_order_only
    def backward(ctx, grad_out: torch.Tensor):
        cos, sin = ctx.saved_tensors
        grad_out = _last_dim_unit(grad_out)
        shape, strides = ctx.grad_layout
        return _rope_rotate(grad_out, cos, sin, 0, True, list(shape), list(strides), ctx.layout), None, None, None


class LigerMLAQueryFunction(torch.autograd.Function):
    """q_states [B, H, S, nope + R] -> query [B, H, S, nope + R] ([B, S, H, D] memory), rope part turned."""

    kernel_ops = ("liger_dspine::rope_rotate", "liger_dspine::rope_unrotate_")

    @staticmethod
    def forward(ctx, q_states, cos, sin, rope_dim: int, layout: str = "interleaved") -> torch.Tensor:
        batch, heads, seq_len, width = q_states.shape
        _check_rope_width(rope_dim)
        nope = width - rope_dim
        if nope < 0:
            raise ValueError(f"liger-dspine: rope_dim {rope_dim} exceeds the head width {width}")
        q_states = _last_dim_unit(q_states)
        cos = _angles(cos, batch, seq_len, rope_dim // 2)
        sin = _angles(sin, batch, seq_len, rope_dim // 2)
        shape, strides = _heads_layout(batch, heads, seq_len, width)
        query = _rope_rotate(q_states, cos, sin, nope, False, list(shape), list(strides), layout)
        ctx.save_for_backward(cos, sin)
        ctx.nope = nope
        ctx.layout = layout
        ctx.grad_layout = _dense_layout(q_states)
        return query

    @staticmethod
    @first_order_only
    def backward(ctx, grad_query: torch.Tensor):
        cos, sin = ctx.saved_tensors
        nope = ctx.nope
        grad_query = _last_dim_unit(grad_query)
        if (tuple(grad_query.shape), grad_query.stride()) == ctx.grad_layout:
            # The incoming gradient already has q_states' layout (attention kernels give it the query's): the
            # pass columns are right as they are, only the rope columns are turned back, in place, instead of
            # writing a new gradient of the whole query.
            _rope_unrotate_(grad_query, cos, sin, nope, ctx.layout)
            return grad_query, None, None, None, None
        shape, strides = ctx.grad_layout
        grad_q_states = _rope_rotate(grad_query, cos, sin, nope, True, list(shape), list(strides), ctx.layout)
        return grad_q_states, None, None, None, None


class LigerMLAKeyFunction(torch.autograd.Function):
    """kv [B, H, S, nope + V], k_rot [B, 1, S, R] -> key [B, H, S, nope + R], value [B, H, S, V] (copied).

    Both outputs are stored as [B, S, H, D].

    ``cos``/``sin`` None: ``k_rot`` is already turned (read back from a cache) and is only broadcast.
    """

    kernel_ops = ("liger_dspine::mla_key", "liger_dspine::mla_key_backward")

    @staticmethod
    def forward(ctx, kv, k_rot, cos, sin, nope_dim: int, layout: str = "interleaved"):
        batch, heads, seq_len, width = kv.shape
        rope_dim = k_rot.shape[-1]
        _check_rope_width(rope_dim)
        if k_rot.shape[:3] != (batch, 1, seq_len):
            raise ValueError(f"liger-dspine: k_rot must be [{batch}, 1, {seq_len}, R], got {tuple(k_rot.shape)}")
        if not 0 <= nope_dim < width:  # 0: keys without a non-rotary part (qk_nope_head_dim=0)
            raise ValueError(f"liger-dspine: nope_dim {nope_dim} must lie in [0, kv width {width})")
        kv = _last_dim_unit(kv)
        k_rot = _last_dim_unit(k_rot)
        if cos is not None:
            cos = _angles(cos, batch, seq_len, rope_dim // 2)
            sin = _angles(sin, batch, seq_len, rope_dim // 2)
        key, value = _mla_key(kv, k_rot, cos, sin, nope_dim, layout)
        if cos is not None:
            ctx.save_for_backward(cos, sin)
        ctx.rotated = cos is not None
        ctx.layout = layout
        ctx.nope = nope_dim
        ctx.kv_layout = _dense_layout(kv)
        ctx.k_rot_layout = _dense_layout(k_rot)
        return key, value

    @staticmethod
    @first_order_only
    def backward(ctx, grad_key: torch.Tensor, grad_value: torch.Tensor):
        cos, sin = ctx.saved_tensors if ctx.rotated else (None, None)
        grad_key = _last_dim_unit(grad_key)
        grad_value = _last_dim_unit(grad_value)
        (kv_shape, kv_strides), (k_rot_shape, k_rot_strides) = ctx.kv_layout, ctx.k_rot_layout
        grad_kv, grad_k_rot = _mla_key_backward(
            grad_key, grad_value, cos, sin, ctx.nope, list(kv_shape), list(kv_strides), list(k_rot_shape),
            list(k_rot_strides), ctx.layout,
        )  # fmt: skip
        return grad_kv, grad_k_rot, None, None, None, None


def liger_interleaved_rope_single(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str = "interleaved"
) -> torch.Tensor:
    """RoPE of one tensor ``x [B, H, S, R]`` (any strides) in ``layout`` (interleaved by default); returns a
    contiguous ``[B, H, S, R]``."""
    _check_constant_angles(cos, sin)
    _check_layout(layout)
    return LigerInterleavedRopeFunction.apply(x, cos, sin, layout)


def liger_interleaved_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for transformers' ``apply_rotary_pos_emb_interleave(q, k, cos, sin)`` (``unsqueeze_dim=1``).

    q: [B, H, S, R], k: [B, Hk, S, R] (any strides, e.g. slices of a larger head), cos/sin: [B or 1, S, R].
    Returns (q_embed, k_embed), contiguous, in the input dtypes. cos/sin get no gradient.
    """
    return liger_interleaved_rope_single(q, cos, sin), liger_interleaved_rope_single(k, cos, sin)


def liger_mla_query(
    q_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int, layout: str = "interleaved"
) -> torch.Tensor:
    """MLA query assembly: ``cat((q_pass, rope(q_rot)), -1)`` in one pass.

    q_states: [B, H, S, nope + rope_dim] (any strides, typically ``q_proj(x).view(B, S, H, D).transpose(1, 2)``);
    its last ``rope_dim`` columns are rope rows in ``layout``'s source arrangement (interleaved pairs by default).
    Returns the query [B, H, S, nope + rope_dim], stored as [B, S, H, D].
    """
    _check_constant_angles(cos, sin)
    _check_layout(layout)
    return LigerMLAQueryFunction.apply(q_states, cos, sin, rope_dim, layout)


def liger_mla_key(
    kv: torch.Tensor,
    k_rot: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    nope_dim: int,
    layout: str = "interleaved",
) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA key assembly: ``key = cat((kv[..., :nope_dim], rope(k_rot).expand(H)), -1)``, value ``kv[..., nope_dim:]``.

    kv: [B, H, S, nope_dim + V] (any strides, typically ``kv_b_proj(latent).view(B, S, H, -1).transpose(1, 2)``),
    k_rot: [B, 1, S, R] in ``layout``'s source arrangement (the rope key shared by all heads), or already turned
    when cos/sin are None. Returns (key [B, H, S, nope_dim + R], value [B, H, S, V]), both stored as [B, S, H, D].
    """
    if (cos is None) != (sin is None):
        raise ValueError("liger-dspine: give both cos and sin, or neither")
    if cos is not None:
        _check_constant_angles(cos, sin)
    _check_layout(layout)
    return LigerMLAKeyFunction.apply(kv, k_rot, cos, sin, nope_dim, layout)
