"""SiLU-and-multiply of the routed experts' gate/up rows and its fused backward, in Triton.

``gate_up`` [S, 2I] holds one (token, expert) pair per row, gate in the first I columns and up in the last I. Math
runs in fp32 on values read once in the storage dtype, with the formulas of :mod:`liger_dspine.ops.grouped_experts`
(which this replaces on GPUs), in the same order:

    forward    act = gate / (1 + exp(-gate)) * up                         rounded once to the dtype

    backward   w = weight_of_row[s], g = grad of the down projection's input, sig = 1 / (1 + exp(-gate))
               act    as in the forward, rounded to the dtype and back (the value the forward produced)
               d_act  = w * g
               d_up   = d_act * gate * sig                                (silu(gate) = gate * sig)
               d_gate = d_act * up * (((1 - sig) * gate + 1) * sig)       (silu'(x) = sig (1 + x (1 - sig)))
               dots[s] = sum_i g * act  (fp32)     the routing-weight gradient, when asked
               scaled  = w * act        (dtype)    the rows the down projection's weight gradient reads, when asked

With a ``limit`` (DeepSeek-V4's ``swiglu_limit``) the SwiGLU is clamped first, as transformers clamps it:

    gate_c = min(gate, limit)            up_c = min(max(up, -limit), limit)
    act    = silu(gate_c) * up_c         and the backward above on gate_c / up_c, with d_gate = 0 where
                                         gate > limit and d_up = 0 where |up| > limit (torch's clamp passes the
                                         gradient on the bounds themselves)

Without a limit the clamp is compiled out (a constexpr), and the kernels are the unclamped ones.

One program per row walks the I columns in blocks: each step reads its gate and up columns before writing their
gradients, so the backward may write ``d_gate_up`` over ``gate_up`` itself. Row offsets are int64 (S * 2I may pass
2**31). On GPUs the exponential is libdevice's and divisions round to nearest, as torch's kernels, so fp32 results
match torch's; Triton's CPU interpreter takes NumPy's exponential instead (an fp32 ulp apart at most).
"""

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from liger_dspine._interpreter import check_kernel_device
from liger_dspine._interpreter import is_interpreted
from liger_dspine._interpreter import kernel_runs_on
from liger_dspine.ops.eager_dispatch import liger_custom_op

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_BLOCK = 2048  # columns per step: one step per row at DeepSeek-V3's I = 2048


@triton.jit
def _exp(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.exp(x)  # torch's expf; tl.exp is an approximation on GPUs
    else:
        return tl.exp(x)  # the interpreter has no libdevice


@triton.jit
def _clamped(gate, up, limit, CLAMP: tl.constexpr):
    """(gate_c, up_c, gate passes gradient, up passes gradient); the inputs themselves without CLAMP."""
    if CLAMP:
        return (
            tl.minimum(gate, limit),
            tl.minimum(tl.maximum(up, -limit), limit),
            gate <= limit,
            (up >= -limit) & (up <= limit),
        )
    else:
        return gate, up, True, True


@triton.jit
def _silu_mul_rows_kernel(
    gate_up_ptr,  # [S, 2I]
    act_ptr,  # [S, I] out
    half,
    gate_up_stride,
    act_stride,
    limit,
    CLAMP: tl.constexpr,
    PRECISE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    gate_row = gate_up_ptr + row * gate_up_stride
    act_row = act_ptr + row * act_stride
    for start in range(0, half, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < half
        gate = tl.load(gate_row + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_row + half + cols, mask=mask, other=0.0).to(tl.float32)
        gate, up, _, _ = _clamped(gate, up, limit, CLAMP)
        act = tl.math.div_rn(gate, 1.0 + _exp(-gate, PRECISE)) * up
        tl.store(act_row + cols, act.to(act_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_rows_backward_kernel(
    gate_up_ptr,  # [S, 2I]
    g_ptr,  # [S, I]
    weight_ptr,  # [S]
    d_gate_up_ptr,  # [S, 2I] out, may be gate_up_ptr
    dots_ptr,  # [S] fp32 out (ROW_DOT)
    scaled_ptr,  # [S, I] out (SCALED_ACT)
    half,
    gate_up_stride,
    g_stride,
    d_gate_up_stride,
    scaled_stride,
    limit,
    CLAMP: tl.constexpr,
    ROW_DOT: tl.constexpr,
    SCALED_ACT: tl.constexpr,
    PRECISE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    gate_row = gate_up_ptr + row * gate_up_stride
    g_row = g_ptr + row * g_stride
    d_row = d_gate_up_ptr + row * d_gate_up_stride
    scaled_row = scaled_ptr + row * scaled_stride
    weight = tl.load(weight_ptr + row).to(tl.float32)
    dot = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, half, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < half
        gate = tl.load(gate_row + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_row + half + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_row + cols, mask=mask, other=0.0).to(tl.float32)
        gate, up, gate_passes, up_passes = _clamped(gate, up, limit, CLAMP)
        denom = 1.0 + _exp(-gate, PRECISE)
        sig = tl.math.div_rn(1.0, denom)
        d_act = weight * g
        d_up = d_act * gate * sig
        d_gate = d_act * up * (((1.0 - sig) * gate + 1.0) * sig)
        if CLAMP:
            d_up = tl.where(up_passes, d_up, 0.0)
            d_gate = tl.where(gate_passes, d_gate, 0.0)
        tl.store(d_row + cols, d_gate.to(d_gate_up_ptr.dtype.element_ty), mask=mask)
        tl.store(d_row + half + cols, d_up.to(d_gate_up_ptr.dtype.element_ty), mask=mask)
        if ROW_DOT or SCALED_ACT:
            act = tl.math.div_rn(gate, denom) * up
            act = act.to(gate_up_ptr.dtype.element_ty).to(tl.float32)
            if ROW_DOT:
                dot += g * act  # masked columns hold 0
            if SCALED_ACT:
                tl.store(scaled_row + cols, (weight * act).to(scaled_ptr.dtype.element_ty), mask=mask)
    if ROW_DOT:
        tl.store(dots_ptr + row, tl.sum(dot, axis=0))


_INTERPRETED = is_interpreted(_silu_mul_rows_kernel)  # the kernels above, decorated under Triton's CPU interpreter


def _launch_options(half: int, limit: float | None) -> dict:
    block = min(triton.next_power_of_2(max(half, 1)), _MAX_BLOCK)
    # separate products and sums, as torch's eager kernels
    return dict(
        limit=0.0 if limit is None else float(limit),
        CLAMP=limit is not None,
        PRECISE=not _INTERPRETED,
        BLOCK=block,
        num_warps=8 if block >= 2048 else 4,
        enable_fp_fusion=False,
    )


def silu_mul_rows_supported(gate_up: torch.Tensor) -> bool:
    """Whether the kernels take ``gate_up``: on CUDA (or a CPU under the interpreter), fp16 / bf16 / fp32, 2-D with
    unit column stride and an even column count. Otherwise the caller keeps its torch path."""
    return (
        kernel_runs_on(gate_up, _silu_mul_rows_kernel)
        and gate_up.dtype in _DTYPES
        and gate_up.dim() == 2
        and gate_up.stride(-1) == 1
        and gate_up.shape[1] % 2 == 0
    )


def _check(gate_up: torch.Tensor, what: str) -> None:
    check_kernel_device(gate_up, what)
    if not silu_mul_rows_supported(gate_up):
        raise ValueError(
            f"liger-dspine: {what} needs a 2-D fp16/bf16/fp32 [S, 2I] tensor with unit column stride, got "
            f"{gate_up.dtype} {tuple(gate_up.shape)} with strides {gate_up.stride()} on {gate_up.device}"
        )


def silu_mul_rows(gate_up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """[S, 2I] -> silu(gate) * up [S, I] in gate_up's dtype, computed in fp32 and rounded once; with ``limit``,
    of the clamped gate and up (module docstring)."""
    _check(gate_up, "SiLU-mul rows")
    return _silu_mul_rows(gate_up, limit)


@liger_custom_op("liger_dspine::silu_mul_rows", mutates_args=())
def _silu_mul_rows(gate_up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    rows, half = gate_up.shape[0], gate_up.shape[1] // 2
    act = gate_up.new_empty(rows, half)
    if rows and half:
        options = _launch_options(half, limit)
        _silu_mul_rows_kernel[(rows,)](gate_up, act, half, gate_up.stride(0), act.stride(0), **options)
    return act


@_silu_mul_rows.register_fake
def _(gate_up, limit=None):
    return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)


def silu_mul_rows_backward(
    gate_up: torch.Tensor,
    g: torch.Tensor,
    weight_of_row: torch.Tensor,
    *,
    row_dot: bool,
    scaled_act: bool,
    in_place: bool,
    limit: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Gradient of ``silu(gate) * up`` (of the clamped gate and up with ``limit``) for d act = ``weight_of_row``
    [S] (or [S, 1]) * ``g`` [S, I].

    Returns ``(d_gate_up [S, 2I], dots [S] fp32 or None, scaled [S, I] or None)``, d_gate_up and scaled in
    gate_up's dtype: ``dots[s] = <g[s], act[s]>`` when ``row_dot``, ``scaled = weight_of_row * act`` when
    ``scaled_act``. With ``in_place`` d_gate_up is written over ``gate_up`` and is ``gate_up`` itself.
    """
    _check(gate_up, "SiLU-mul rows backward")
    rows, half = gate_up.shape[0], gate_up.shape[1] // 2
    if g.shape != (rows, half):
        raise ValueError(f"liger-dspine: SiLU-mul rows backward needs g of shape {(rows, half)}, got {tuple(g.shape)}")
    if weight_of_row.numel() != rows:
        raise ValueError(f"liger-dspine: SiLU-mul rows backward needs {rows} row weights, got {weight_of_row.numel()}")
    g = g if g.stride(-1) == 1 else g.contiguous()
    weight_of_row = weight_of_row.reshape(-1).contiguous()
    if in_place:
        dots, scaled = _silu_mul_rows_backward_(gate_up, g, weight_of_row, row_dot, scaled_act, limit)
        d_gate_up = gate_up
    else:
        d_gate_up, dots, scaled = _silu_mul_rows_backward(gate_up, g, weight_of_row, row_dot, scaled_act, limit)
    return d_gate_up, dots if row_dot else None, scaled if scaled_act else None


def _backward_outputs(gate_up: torch.Tensor, row_dot: bool, scaled_act: bool):
    """(dots [S] fp32, scaled [S, I]), each empty ([0]) when not asked for."""
    rows, half = gate_up.shape[0], gate_up.shape[1] // 2
    # every row is written, or (I = 0) the dot of empty rows is 0
    dots = (torch.empty if half else torch.zeros)(rows if row_dot else 0, dtype=torch.float32, device=gate_up.device)
    scaled = gate_up.new_empty(rows, half) if scaled_act else gate_up.new_empty(0)
    return dots, scaled


def _launch_backward(
    gate_up, g, weight_of_row, d_gate_up, dots, scaled, row_dot: bool, scaled_act: bool, limit
) -> None:
    rows, half = gate_up.shape[0], gate_up.shape[1] // 2
    if rows and half:
        _silu_mul_rows_backward_kernel[(rows,)](
            gate_up,
            g,
            weight_of_row,
            d_gate_up,
            dots if row_dot else weight_of_row,  # unused pointers: never read nor written (constexpr branches)
            scaled if scaled_act else gate_up,
            half,
            gate_up.stride(0),
            g.stride(0),
            d_gate_up.stride(0),
            scaled.stride(0) if scaled_act else 0,
            ROW_DOT=row_dot,
            SCALED_ACT=scaled_act,
            **_launch_options(half, limit),
        )


@liger_custom_op("liger_dspine::silu_mul_rows_backward", mutates_args=())
def _silu_mul_rows_backward(
    gate_up: torch.Tensor,
    g: torch.Tensor,
    weight_of_row: torch.Tensor,
    row_dot: bool,
    scaled_act: bool,
    limit: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d_gate_up, dots, scaled), d_gate_up in a new buffer; dots / scaled empty when not asked for."""
    d_gate_up = torch.empty(gate_up.shape, dtype=gate_up.dtype, device=gate_up.device)
    dots, scaled = _backward_outputs(gate_up, row_dot, scaled_act)
    _launch_backward(gate_up, g, weight_of_row, d_gate_up, dots, scaled, row_dot, scaled_act, limit)
    return d_gate_up, dots, scaled


@_silu_mul_rows_backward.register_fake
def _(gate_up, g, weight_of_row, row_dot, scaled_act, limit=None):
    return torch.empty(gate_up.shape, dtype=gate_up.dtype, device=gate_up.device), *_backward_outputs(
        gate_up, row_dot, scaled_act
    )


@liger_custom_op("liger_dspine::silu_mul_rows_backward_", mutates_args=("gate_up",))
def _silu_mul_rows_backward_(
    gate_up: torch.Tensor,
    g: torch.Tensor,
    weight_of_row: torch.Tensor,
    row_dot: bool,
    scaled_act: bool,
    limit: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same with d_gate_up written over gate_up (its version is bumped); returns (dots, scaled)."""
    dots, scaled = _backward_outputs(gate_up, row_dot, scaled_act)
    _launch_backward(gate_up, g, weight_of_row, gate_up, dots, scaled, row_dot, scaled_act, limit)
    return dots, scaled


@_silu_mul_rows_backward_.register_fake
def _(gate_up, g, weight_of_row, row_dot, scaled_act, limit=None):
    return _backward_outputs(gate_up, row_dot, scaled_act)
