"""Routed SwiGLU experts on grouped GEMMs, keeping only the gate/up projection output for backward.

Same math as transformers' batched experts (``DeepseekV3Experts``, gate rows first in ``gate_up_proj``)::

    gate, up = x @ gate_up_proj[e].T  split in halves of I    # [2I] per (token, expert) pair
    out[t]   = sum_k w[t, k] * (silu(gate) * up) @ down_proj[e].T

The T*K (token, expert) pairs are sorted by expert (S = T*K rows) so that every projection is one grouped GEMM:
``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm`` on CUDA, a per-expert ``torch.mm`` loop elsewhere.

transformers' ``grouped_mm`` experts keep four [S, *] tensors for backward: the gathered inputs [S, H], the gate/up
output [S, 2I], the activation [S, I] and the down output [S, H] (for the routing-weight gradient). This op keeps the
gate/up output only, plus small integer tensors (the sort permutation and the group offsets), and the hidden states
and routing weights it was given. Backward recomputes the rest:

- the activation from the gate/up output, the gathered inputs by a gather of the hidden states;
- with g = grad_out[t] @ down_proj[e] (a grouped GEMM the input gradient needs anyway), the routing-weight gradient
  is d_w[t, k] = <g, act> over I (no down output needed), and d_act = w[t, k] * g.

GEMMs run in the input dtype (bf16 on GPU: fp32 accumulation inside the GEMM); the SiLU-and-multiply, its
derivative, the routing-weight products and the sums over the K slots of a token run in fp32, as transformers sums
its weighted expert outputs in the (fp32) routing-weight dtype. The K slots of a token are summed by gathers in a
fixed order (no atomics), so forward and backward are deterministic.

With ``limit`` (DeepSeek-V4's ``swiglu_limit``) gate and up are clamped before the SiLU-mul, as transformers'
``DeepseekV4Experts`` clamps them: ``gate.clamp(max=limit)``, ``up.clamp(-limit, limit)``; no gradient flows
through a clamped value.

With ``fp8=True`` every grouped GEMM (forward gate/up and down; backward grad_out @ down_proj, the input gradient
and both weight gradients) runs on e4m3 operands with dynamic rowwise scales (:mod:`liger_dspine.ops.fp8_expert_groups`,
which states the per-call cost of quantising the weights); the elementwise math, the slot sums and what is saved for
backward (the gate/up output, in the GEMM dtype) are unchanged.

Expert ids must lie in [0, E) (no expert-parallel sentinels); the CPU loop checks it, CUDA does not (a host sync).
"""

import torch
import torch.nn.functional as F
from packaging.version import Version

from liger_dspine.ops.eager_dispatch import liger_custom_op
from liger_dspine.ops.first_order import first_order_only
from liger_dspine.ops.fp8_expert_groups import FP8_EXPERTS_OPS
from liger_dspine.ops.fp8_expert_groups import FP8ExpertGroups
from liger_dspine.ops.fp8_expert_groups import check_fp8_experts
from liger_dspine.ops.fp8_expert_groups import quantised_rowwise
from liger_dspine.ops.gemm_dtype import gemm_dtype
from liger_dspine.ops.silu_mul_rows import silu_mul_rows
from liger_dspine.ops.silu_mul_rows import silu_mul_rows_backward
from liger_dspine.ops.silu_mul_rows import silu_mul_rows_supported
from liger_dspine.ops.slot_sum import slot_sum
from liger_dspine.ops.slot_sum import slot_sum_supported

_GEMM_ALIGNMENT_BYTES = 16  # torch's grouped GEMM: 16-byte aligned data pointers and leading strides


def torch_grouped_mm_function():
    """``torch.nn.functional.grouped_mm`` (torch >= 2.10), else ``torch._grouped_mm``, else None; looked up at
    each call."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def torch_grouped_mm_supported(device: torch.device) -> bool:
    """Whether torch's grouped GEMM runs on ``device``, by transformers' rule: CUDA only, compute capability 8.0+
    (9.x for ``torch._grouped_mm`` before torch 2.9). On CPU this op takes the per-expert loop."""
    if device.type != "cuda" or torch_grouped_mm_function() is None:
        return False
    capability = torch.cuda.get_device_capability(device)
    if hasattr(F, "grouped_mm") or Version(torch.__version__).release >= (2, 9):
        return capability >= (8, 0)
    return capability[0] == 9


def _aligned(dtype: torch.dtype, sizes: tuple[int, ...], tensors: tuple[torch.Tensor, ...]) -> bool:
    elements = _GEMM_ALIGNMENT_BYTES // dtype.itemsize
    return all(size % elements == 0 for size in sizes) and all(
        t.data_ptr() % _GEMM_ALIGNMENT_BYTES == 0 for t in tensors
    )


def use_torch_grouped_mm(
    hidden_states: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, dtype: torch.dtype
) -> bool:
    """The branch this op takes: torch's grouped GEMM where the device supports it and every operand meets its
    16-byte alignment (H and I multiples of 16 bytes, weights at aligned addresses), else the per-expert loop (also
    for no tokens at all)."""
    if not torch_grouped_mm_supported(hidden_states.device) or hidden_states.shape[0] == 0:
        return False
    return _aligned(dtype, (hidden_states.shape[-1], down_proj.shape[-1]), (gate_up_proj, down_proj))


def _check_expert_ids(sorted_experts: torch.Tensor, num_experts: int) -> None:
    if sorted_experts.numel() == 0:
        return
    low, high = sorted_experts[[0, -1]].tolist()
    if low < 0 or high >= num_experts:
        raise ValueError(f"liger-dspine: grouped experts got expert ids in [{low}, {high}], outside [0, {num_experts})")


def _empty_groups_are_zeros(device: torch.device) -> bool:
    """torch's grouped GEMM writes zeros for empty groups of the 2-D x 2-D form on Hopper (compute capability 9.x)
    and on CPU."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] == 9


class ExpertGroups:
    """The S expert-sorted rows split in E contiguous groups; ``offsets[e]`` is where group e ends (int32, [E]).

    ``use_torch`` picks torch's grouped GEMM; otherwise a per-expert ``torch.mm`` loop over the offsets, read to the
    host once (one sync), which skips empty groups.
    """

    def __init__(self, offsets: torch.Tensor, use_torch: bool):
        self.offsets = offsets
        self.use_torch = use_torch
        self.bounds = None
        if not use_torch:
            ends = offsets.tolist()
            self.bounds = list(zip([0] + ends[:-1], ends))

    def rows_mm(self, rows: torch.Tensor, weights: torch.Tensor, weight_amax: None = None) -> torch.Tensor:
        """[S, K'] rows, [E, K', N] weights -> [S, N]: each group's rows times its expert's matrix. (``weight_amax``
        is the FP8 groups'; these GEMMs quantise nothing.)"""
        if weight_amax is not None:
            raise ValueError("liger-dspine: a weight amax is for FP8 expert groups only")
        if self.use_torch:
            return torch_grouped_mm_function()(rows, weights, offs=self.offsets)
        out = rows.new_zeros(rows.shape[0], weights.shape[2])
        for expert, (start, end) in enumerate(self.bounds):
            if start < end:
                torch.mm(rows[start:end], weights[expert], out=out[start:end])
        return out

    def rows_mm_keeping_amax(self, rows: torch.Tensor, weights: torch.Tensor):
        """(:meth:`rows_mm`, None): these GEMMs quantise nothing, so there is no amax to keep."""
        return self.rows_mm(rows, weights), None

    def weight_grad(self, left: torch.Tensor, right: torch.Tensor, right_rows: torch.Tensor | None = None):
        """[M, S] and [S, N] (or ``right[right_rows]``) -> [E, M, N]: per group, the product over its rows (a weight
        gradient); zeros for an expert with no rows."""
        if right_rows is not None:
            right = right[right_rows]
        if self.use_torch:
            out = torch_grouped_mm_function()(left, right, offs=self.offsets)
            if not _empty_groups_are_zeros(out.device):
                # pytorch/pytorch#172439: on other GPUs, zero the empty groups' gradients explicitly (a pass over
                # the whole [E, M, N] gradient, about 1 ms for DeepSeek-V3's gate/up at 16 experts)
                counts = torch.diff(self.offsets, prepend=self.offsets.new_zeros(1))
                out.masked_fill_((counts == 0)[:, None, None], 0)
            return out
        out = left.new_zeros(len(self.bounds), left.shape[0], right.shape[1])
        for expert, (start, end) in enumerate(self.bounds):
            if start < end:
                torch.mm(left[:, start:end], right[start:end], out=out[expert])
        return out


def wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype elementwise math runs in: fp32, or the input's own when wider (fp64)."""
    return torch.promote_types(dtype, torch.float32)


# Rows per piece of the fp32 elementwise math: its temporaries stay near 64 MiB per [rows, I] tensor at I = 2048
# instead of growing with the token count (the MoE backward runs while most activations are still alive).
_ELEMENTWISE_ROWS = 8192


def _row_pieces(rows: int):
    return [(start, min(start + _ELEMENTWISE_ROWS, rows)) for start in range(0, rows, _ELEMENTWISE_ROWS)]


def silu_mul(gate_up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """[S, 2I] -> silu(gate) * up [S, I] in gate_up's dtype, computed in fp32 (gate = first I columns); with
    ``limit``, of the clamped gate and up."""
    act = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    for start, end in _row_pieces(gate_up.shape[0]):
        gate, up = gate_up[start:end].chunk(2, dim=-1)
        if limit is None:
            act[start:end] = F.silu(gate.to(wide(gate.dtype))).mul_(up)
        else:
            gate, up = gate.to(wide(gate.dtype)).clamp(max=limit), up.to(wide(up.dtype)).clamp(-limit, limit)
            act[start:end] = F.silu(gate).mul_(up)
    return act


def silu_mul_backward(
    gate_up: torch.Tensor, g: torch.Tensor, weight_of_row: torch.Tensor, limit: float | None = None
) -> torch.Tensor:
    """d(silu(gate) * up) / d(gate, up) applied to d act = ``weight_of_row`` [S, 1] * ``g`` [S, I], in fp32:
    [S, 2I] in gate_up's dtype; with ``limit``, through the clamps (zero where a value was clamped)."""
    d_gate_up = torch.empty_like(gate_up)
    half = gate_up.shape[1] // 2
    for start, end in _row_pieces(gate_up.shape[0]):
        gate, up = gate_up[start:end].to(wide(gate_up.dtype)).chunk(2, dim=-1)  # read only (may be the saved one)
        d_act = g[start:end].to(wide(g.dtype)) * weight_of_row[start:end]
        if limit is not None:
            gate_passes, up_passes = gate <= limit, (up >= -limit) & (up <= limit)
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        sig = torch.sigmoid(gate)
        d_up = d_act * gate * sig
        silu_grad = (1.0 - sig).mul_(gate).add_(1.0).mul_(sig)  # silu'(x) = sig(x) * (1 + x * (1 - sig(x)))
        d_gate = d_act.mul_(up).mul_(silu_grad)
        if limit is not None:
            d_up.masked_fill_(~up_passes, 0.0)
            d_gate.masked_fill_(~gate_passes, 0.0)
        d_gate_up[start:end, half:] = d_up
        d_gate_up[start:end, :half] = d_gate
    return d_gate_up


def scaled_rows(rows: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """rows [S, I] times scale [S, 1], multiplied in fp32 (or wider) and stored in ``dtype``, piece by piece."""
    out = torch.empty(rows.shape, dtype=dtype, device=rows.device)
    for start, end in _row_pieces(rows.shape[0]):
        out[start:end] = rows[start:end].to(wide(rows.dtype)) * scale[start:end]
    return out


def row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[S, I] x [S, I] -> [S] row-wise dot products in fp32 (or wider), piece by piece."""
    out = torch.empty(a.shape[0], dtype=wide(a.dtype), device=a.device)
    for start, end in _row_pieces(a.shape[0]):
        out[start:end] = torch.linalg.vecdot(a[start:end].to(out.dtype), b[start:end].to(out.dtype))
    return out


def sum_slots(rows: torch.Tensor, row_of_slot: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """[T, H] fp32: sum over k of ``rows[row_of_slot[t, k]]`` (times ``scale[t, k]``), slot by slot in order."""
    total = rows[row_of_slot[:, 0]].to(wide(rows.dtype))
    if scale is not None:
        total.mul_(scale[:, :1])
    for k in range(1, row_of_slot.shape[1]):
        if scale is None:
            total.add_(rows[row_of_slot[:, k]])
        else:
            total.addcmul_(rows[row_of_slot[:, k]], scale[:, k : k + 1])
    return total


def summed_slots(rows, row_of_slot, scale, dtype: torch.dtype) -> torch.Tensor:
    """:func:`sum_slots` in ``dtype``: one Triton pass where it runs (:mod:`liger_dspine.ops.slot_sum`)."""
    if slot_sum_supported(rows, scale):
        return slot_sum(rows, row_of_slot, scale, dtype)
    return sum_slots(rows, row_of_slot, scale).to(dtype)


class LigerGroupedExpertsFunction(torch.autograd.Function):
    """(hidden_states [T, H], top_k_index [T, K] int, top_k_weights [T, K] float, gate_up_proj [E, 2I, H],
    down_proj [E, H, I], limit, fp8) -> [T, H] in hidden_states' dtype.

    Forward and backward are each one custom op (opaque to torch.compile: the per-expert loop reads the group
    bounds on the host, and the grouped GEMM's alignment check reads data pointers)."""

    kernel_ops = (
        "liger_dspine::grouped_experts",
        "liger_dspine::grouped_experts_backward_",
        *FP8_EXPERTS_OPS,
    )

    @staticmethod
    def forward(ctx, hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, limit=None, fp8=False):
        dtype = gemm_dtype(hidden_states, gate_up_proj, "grouped experts")
        if down_proj.dtype != gate_up_proj.dtype:
            raise ValueError(
                f"liger-dspine: grouped experts need one weight dtype; gate_up_proj is {gate_up_proj.dtype} and "
                f"down_proj is {down_proj.dtype}"
            )
        if fp8:
            check_fp8_experts(hidden_states.device, dtype, gate_up_proj.shape[2], down_proj.shape[2])
        out, *saved_outputs = _grouped_experts(
            hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, dtype, limit, fp8
        )
        # perm, row_of_slot, offsets, gate_up and (FP8) the weights' column amaxes
        saved = (hidden_states, top_k_weights, gate_up_proj, down_proj, *saved_outputs)
        ctx.save_for_backward(*saved)
        ctx.gemm_dtype, ctx.limit, ctx.fp8 = dtype, limit, fp8
        return out

    @staticmethod
    @first_order_only
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors  # unpacked once: gradient checkpointing allows a single unpack
        need_x, _, need_weights, need_gate_up, need_down = ctx.needs_input_grad[:5]
        args = (grad_out, *saved, ctx.gemm_dtype, need_x, need_weights, need_gate_up, need_down, ctx.limit, ctx.fp8)
        # The fused backward writes d gate_up over the saved gate_up output. Eager: its version is bumped, so a second
        # backward fails loudly. Compiled: functionalisation turns the write into a copy, which inductor places in
        # the saved buffer itself when AOT autograd donates it to the backward (no retain_graph), else in a new one.
        grads = _grouped_experts_backward_(*args)
        grad_x, grad_weights, grad_gate_up, grad_down = (
            grad if need else None for grad, need in zip(grads, (need_x, need_weights, need_gate_up, need_down))
        )
        return grad_x, None, grad_weights, grad_gate_up, grad_down, None, None


def _forward_outputs_fake(hidden_states, top_k_index, gate_up_proj, dtype):
    """(out [T, H], perm [S], row_of_slot [S], offsets [E] int32, gate_up [S, 2I]) without values."""
    slots = top_k_index.numel()
    device = hidden_states.device
    return (
        hidden_states.new_empty(hidden_states.shape),
        torch.empty(slots, dtype=torch.int64, device=device),
        torch.empty(slots, dtype=torch.int64, device=device),
        torch.empty(gate_up_proj.shape[0], dtype=torch.int32, device=device),
        torch.empty(slots, gate_up_proj.shape[1], dtype=dtype, device=device),
    )


@liger_custom_op("liger_dspine::grouped_experts", mutates_args=())
def _grouped_experts(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    dtype: torch.dtype,
    limit: float | None = None,
    fp8: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward: (out [T, H], perm [S], row_of_slot [S], offsets [E] int32, gate_up [S, 2I], amax_gate_up,
    amax_down); the last six are what the backward needs. With ``fp8`` the amaxes are the weights' column amaxes
    that the backward's column quantisers take ([E, H] over gate_up_proj's 2I rows, [E, I] over down_proj's H rows;
    int32 fp32 bits), else empty."""
    num_tokens, top_k = top_k_index.shape
    num_experts = gate_up_proj.shape[0]
    device = hidden_states.device
    use_torch = not fp8 and use_torch_grouped_mm(hidden_states, gate_up_proj, down_proj, dtype)

    with torch.autocast(device.type, enabled=False):
        # sort the (token, slot) pairs by expert; a stable sort keeps the result independent of the backend
        sorted_experts, perm = torch.sort(top_k_index.reshape(-1).to(torch.int64), stable=True)
        expert_ids = torch.arange(num_experts, device=device, dtype=sorted_experts.dtype)
        offsets = torch.searchsorted(sorted_experts, expert_ids, right=True, out_int32=True)
        if not (use_torch or fp8 and device.type == "cuda"):  # the loop syncs with the host anyway
            _check_expert_ids(sorted_experts, num_experts)
        row_of_slot = torch.empty_like(perm)  # inverse permutation: sorted row of flat slot t * K + k
        row_of_slot[perm] = torch.arange(perm.numel(), device=device)
        groups = FP8ExpertGroups(offsets) if fp8 else ExpertGroups(offsets, use_torch)

        x_sorted = hidden_states.to(dtype)[perm // top_k]  # [S, H]
        gate_up, amax_gate_up = _rows_mm(groups, x_sorted, gate_up_proj.to(dtype).transpose(1, 2))  # [S, 2I]
        del x_sorted
        act = silu_mul_rows(gate_up, limit) if silu_mul_rows_supported(gate_up) else silu_mul(gate_up, limit)
        y, amax_down = _rows_mm(groups, act, down_proj.to(dtype).transpose(1, 2))  # [S, H]
        del act
        slot_weights = top_k_weights.to(wide(top_k_weights.dtype))
        out = summed_slots(y, row_of_slot.view(num_tokens, top_k), slot_weights, hidden_states.dtype)
    return out, perm, row_of_slot, offsets, gate_up, amax_gate_up, amax_down


def _rows_mm(groups, rows: torch.Tensor, weights: torch.Tensor):
    """(groups.rows_mm(rows, weights), the weights' amax the backward takes: FP8 groups only, else empty, and empty
    where the weights' layout gives none)."""
    out, amax = groups.rows_mm_keeping_amax(rows, weights)
    return out, rows.new_empty(0, dtype=torch.int32) if amax is None else amax


@_grouped_experts.register_fake
def _(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, dtype, limit=None, fp8=False):
    outputs = _forward_outputs_fake(hidden_states, top_k_index, gate_up_proj, dtype)
    # a weight's amax ([E, its last dim]) where FP8 quantises it rowwise in its own layout (the forward's operand is
    # its transpose)
    kept = [fp8 and quantised_rowwise(w.to(dtype).transpose(1, 2)) for w in (gate_up_proj, down_proj)]
    amax_shapes = [(w.shape[0], w.shape[2]) if keep else (0,) for w, keep in zip((gate_up_proj, down_proj), kept)]
    return (*outputs, *(torch.empty(shape, dtype=torch.int32, device=hidden_states.device) for shape in amax_shapes))


class _BackwardContext:
    """What the backward helpers read: the input-gradient flags, the expert groups, the GEMM dtype, the clamp limit
    and (FP8) the weights' column amaxes kept by the forward (an empty tensor: None)."""

    def __init__(self, needs_input_grad, groups, gemm_dtype, limit, amax_gate_up, amax_down):
        self.needs_input_grad, self.groups, self.gemm_dtype, self.limit = needs_input_grad, groups, gemm_dtype, limit
        self.amax_gate_up, self.amax_down = (amax if amax.numel() else None for amax in (amax_gate_up, amax_down))


def _backward(grad_out, hidden_states, top_k_weights, gate_up_proj, down_proj, perm, row_of_slot, offsets, gate_up,
              amax_gate_up, amax_down, dtype, need_x, need_weights, need_gate_up, need_down, limit, fp8,
              in_place):  # fmt: skip
    """(grad_x, grad_weights, grad_gate_up, grad_down), each None when not needed. ``in_place``: the fused path
    may write d gate_up over ``gate_up``. ``amax_gate_up`` / ``amax_down``: the weights' column amaxes from the
    forward (FP8; empty otherwise)."""
    if fp8:
        groups = FP8ExpertGroups(offsets)
    else:
        groups = ExpertGroups(offsets, use_torch_grouped_mm(hidden_states, gate_up_proj, down_proj, dtype))
    needs = (need_x, False, need_weights, need_gate_up, need_down)
    ctx = _BackwardContext(needs, groups, dtype, limit, amax_gate_up, amax_down)
    saved = (hidden_states, top_k_weights, gate_up_proj, down_proj, perm, row_of_slot, gate_up)
    grad_x = grad_weights = grad_gate_up = grad_down = None
    num_tokens, top_k = top_k_weights.shape
    token_of_row = perm // top_k
    slots = row_of_slot.view(num_tokens, top_k)

    with torch.autocast(grad_out.device.type, enabled=False):
        weight_of_row = top_k_weights.reshape(-1)[perm].to(wide(top_k_weights.dtype))[:, None]  # [S, 1]
        fused = (need_x or need_weights or need_gate_up) and weight_of_row.dtype == torch.float32
        if fused and silu_mul_rows_supported(gate_up):
            return _fused_backward(ctx, saved, grad_out, weight_of_row, in_place)
        act = silu_mul(gate_up, limit) if need_down or need_weights else None  # [S, I], bit for bit as in forward
        grad_sorted = grad_out.to(dtype)[token_of_row]  # [S, H]
        if need_down:
            # d down_proj[e] = sum over its rows of (w * grad_out)^T act = grad_out^T (w * act)
            grad_down = groups.weight_grad(grad_sorted.t(), scaled_rows(act, weight_of_row, dtype))
            grad_down = grad_down.to(down_proj.dtype)
        if not (need_x or need_weights or need_gate_up):
            return None, None, None, grad_down

        g = groups.rows_mm(grad_sorted, down_proj.to(dtype), ctx.amax_down)  # [S, I]: grad_out[t] @ down_proj[e]
        del grad_sorted
        if need_weights:
            # d w[t, k] = <grad_out[t], down_proj[e] @ act> = <g, act>
            grad_of_row = row_dot(g, act)
            grad_weights = grad_of_row[row_of_slot].view(num_tokens, top_k).to(top_k_weights.dtype)
        del act
        if not (need_x or need_gate_up):
            return None, grad_weights, None, grad_down

        d_gate_up = silu_mul_backward(gate_up, g, weight_of_row, limit)  # [S, 2I], from d act = w * g
        del g
        grad_x, grad_gate_up = _grads_through_gate_up(ctx, d_gate_up, hidden_states, gate_up_proj, token_of_row, slots)
    return grad_x, grad_weights, grad_gate_up, grad_down


def _backward_outputs(grads, like: torch.Tensor):
    """The four gradients with an empty [0] tensor for each one not computed (custom ops return tensors)."""
    return tuple(like.new_empty(0) if g is None else g for g in grads)


def _backward_fake(grad_out, hidden_states, top_k_weights, gate_up_proj, down_proj, perm, row_of_slot, offsets,
                   gate_up, amax_gate_up, amax_down, dtype, need_x, need_weights, need_gate_up, need_down, limit=None,
                   fp8=False):  # fmt: skip
    shapes = (hidden_states, top_k_weights, gate_up_proj, down_proj)
    needs = (need_x, need_weights, need_gate_up, need_down)
    return tuple(
        torch.empty(t.shape, dtype=t.dtype, device=t.device) if need else hidden_states.new_empty(0)
        for t, need in zip(shapes, needs)
    )


@liger_custom_op("liger_dspine::grouped_experts_backward_", mutates_args=("gate_up",))
def _grouped_experts_backward_(
    grad_out: torch.Tensor,
    hidden_states: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    perm: torch.Tensor,
    row_of_slot: torch.Tensor,
    offsets: torch.Tensor,
    gate_up: torch.Tensor,
    amax_gate_up: torch.Tensor,
    amax_down: torch.Tensor,
    dtype: torch.dtype,
    need_x: bool,
    need_weights: bool,
    need_gate_up: bool,
    need_down: bool,
    limit: float | None = None,
    fp8: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_x, grad_weights, grad_gate_up, grad_down), an empty [0] tensor for each one not needed; d gate_up may be
    written over the saved ``gate_up``."""
    args = (grad_out, hidden_states, top_k_weights, gate_up_proj, down_proj, perm, row_of_slot, offsets, gate_up)
    args += (amax_gate_up, amax_down, dtype, need_x, need_weights, need_gate_up, need_down, limit, fp8)
    grads = _backward(*args, in_place=True)
    return _backward_outputs(grads, hidden_states)


_grouped_experts_backward_.register_fake(_backward_fake)


def _fused_backward(ctx, saved, grad_out, weight_of_row, in_place):
    """The backward with the elementwise math in one Triton pass (:mod:`liger_dspine.ops.silu_mul_rows`), which
    writes d gate_up over the saved gate_up output with ``in_place``. ``saved``: the tensors the forward saved."""
    hidden_states, top_k_weights, gate_up_proj, down_proj, perm, row_of_slot, gate_up = saved
    _, _, need_weights, _, need_down = ctx.needs_input_grad
    grad_x = grad_weights = grad_down = None
    groups, dtype = ctx.groups, ctx.gemm_dtype
    num_tokens, top_k = top_k_weights.shape
    token_of_row = perm // top_k

    grad_sorted = grad_out.to(dtype)[token_of_row]  # [S, H]
    g = groups.rows_mm(grad_sorted, down_proj.to(dtype), ctx.amax_down)  # [S, I]: grad_out[t] @ down_proj[e]
    d_gate_up, dots, scaled = silu_mul_rows_backward(
        gate_up, g, weight_of_row, row_dot=need_weights, scaled_act=need_down, in_place=in_place, limit=ctx.limit
    )
    del g
    if need_down:
        # d down_proj[e] = sum over its rows of (w * grad_out)^T act = grad_out^T (w * act)
        grad_down = groups.weight_grad(grad_sorted.t(), scaled).to(down_proj.dtype)
    del grad_sorted, scaled
    if need_weights:
        # d w[t, k] = <grad_out[t], down_proj[e] @ act> = <g, act>
        grad_weights = dots[row_of_slot].view(num_tokens, top_k).to(top_k_weights.dtype)
    slots = row_of_slot.view(num_tokens, top_k)
    grad_x, grad_gate_up = _grads_through_gate_up(ctx, d_gate_up, hidden_states, gate_up_proj, token_of_row, slots)
    return grad_x, grad_weights, grad_gate_up, grad_down


def _grads_through_gate_up(ctx, d_gate_up, hidden_states, gate_up_proj, token_of_row, slots):
    """From d gate_up [S, 2I]: (d hidden_states [T, H], d gate_up_proj), each None when not needed.

    The input gradient comes first and is summed over each token's slots before the weight gradient's [E, 2I, H]
    output is allocated: the [S, H] rows' gradient and (FP8) the transient e4m3 copy of gate_up_proj are gone by
    then. The inputs are gathered again inside the weight gradient, so FP8 frees the bf16 gather once quantised."""
    need_x, need_gate_up = ctx.needs_input_grad[0], ctx.needs_input_grad[3]
    groups, dtype = ctx.groups, ctx.gemm_dtype
    grad_x = grad_gate_up = None
    if need_x:
        d_x_sorted = groups.rows_mm(d_gate_up, gate_up_proj.to(dtype), ctx.amax_gate_up)  # [S, H]
        grad_x = summed_slots(d_x_sorted, slots, None, hidden_states.dtype)
        del d_x_sorted
    if need_gate_up:
        grad_gate_up = groups.weight_grad(d_gate_up.t(), hidden_states.to(dtype), token_of_row)
        grad_gate_up = grad_gate_up.to(gate_up_proj.dtype)
    return grad_x, grad_gate_up


def liger_grouped_experts(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    limit: float | None = None,
    fp8: bool = False,
) -> torch.Tensor:
    """Routed SwiGLU experts: hidden_states [T, H], top_k_index [T, K] (ids in [0, E)), top_k_weights [T, K],
    gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I] -> [T, H]; ``limit`` clamps gate and up; ``fp8``
    runs the GEMMs on e4m3 operands (module docstring): H and I multiples of 16, and on CUDA bf16 on a GPU of compute
    capability 9.0 or 10.0."""
    args = (hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj)
    return LigerGroupedExpertsFunction.apply(*args, None if limit is None else float(limit), bool(fp8))
