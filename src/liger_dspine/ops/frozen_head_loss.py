"""The weighted frozen-head loss of the DSpine objective, with its input gradient formed in the forward.

    loss = sum_r a_r * ce_r + b_r * l1_r

for per-row weights a (CE) and b (L1) known before the backward; ce and l1 are the frozen-head terms of
:mod:`liger_dspine.ops.frozen_head_objective`. Since the loss's gradient reaches every row only through the one
scalar g = d out / d loss, dz = a * dce/dz + b * dl1/dz can be formed chunk by chunk in the forward and projected
at once: dx = dz W is kept ([R, H], fp32 where the GEMM can write it) and the backward returns g * dx. Per chunk
that is one GEMM for draft and teacher logits together, one kernel for the statistics, the top-k and dz (the top-k
and the gradient kernel apart for K above the kernel's limit) and one GEMM for dx: the three [C, H] x [H, V]
products of the floor, nothing recomputed.

The kept dx is never changed, so a retained graph gives the same gradient on every backward. Without autograd
(or when x needs no gradient) the gradient kernel and its GEMM are skipped: the CE-only prepass of gradient
accumulation costs one GEMM and one pass over the logits per chunk.
"""

import torch

from liger_dspine._interpreter import check_kernel_device
from liger_dspine.ops.eager_dispatch import liger_custom_op
from liger_dspine.ops.first_order import first_order_only
from liger_dspine.ops.frozen_head_kernels import RowResults
from liger_dspine.ops.frozen_head_kernels import check_inputs
from liger_dspine.ops.frozen_head_kernels import chunk_passes
from liger_dspine.ops.frozen_head_kernels import stats_write_grad
from liger_dspine.ops.frozen_head_kernels import write_logit_grads
from liger_dspine.ops.frozen_head_results import FrozenHeadLoss
from liger_dspine.ops.frozen_head_results import FrozenHeadTerms

# Logits buffer budget of one chunk: [2C, V] in the GEMM dtype (draft and teacher rows together).
DEFAULT_CHUNK_BYTES = 640 * 2**20


def loss_chunk_rows(
    rows: int, vocab_size: int, element_size: int, has_teacher: bool, budget: int, hidden: int = 0, sms: int = 0
) -> int:
    """Rows per chunk: at most ``rows``, at least 1, their logits within ``budget`` bytes.

    Without ``sms`` (the GPU's streaming multiprocessors; the CPU): the largest power of two that fits. With it, the
    height whose input-gradient GEMM ([C, V] x [V, H] -> [C, H]) fills its last wave of output tiles best, among the
    multiples of 128 that fit (the largest of those within 2 % of the best). That GEMM has a short output and a
    long reduction, so a partly empty last wave costs its full time: on an H200 at H 7168 its output is 224 tiles of
    128 x 256 at C 1024 (1.7 waves of 132) and 252 at C 1152 (1.9), and C 1152 ran the chunk's two head GEMMs 4 %
    faster per row.
    """
    per_row = vocab_size * element_size * (2 if has_teacher else 1)
    fit = max(1, budget // per_row)
    if not sms or fit < 128 or rows <= 128:
        return max(1, min(rows, 1 << (fit.bit_length() - 1)))
    column_tiles = -(-hidden // 256)

    def fill(height: int) -> float:
        tiles = -(-height // 128) * column_tiles
        return tiles / (-(-tiles // sms) * sms)

    heights = range(128, min(fit, -(-rows // 128) * 128) + 1, 128)
    best = max(fill(h) for h in heights)
    return min(rows, max(h for h in heights if fill(h) >= 0.98 * best))


def _project_grads(dz: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    """out [C, H] fp32 = dz [C, V] @ W [V, H], accumulated and written in fp32 where cuBLAS allows it."""
    if dz.dtype == torch.float32 or dz.device.type != "cuda":
        out.copy_(dz.mm(weight))
        return
    try:
        out.copy_(torch.mm(dz, weight, out_dtype=torch.float32))
    except (RuntimeError, TypeError, NotImplementedError):
        out.copy_(dz.mm(weight))


@liger_custom_op("liger_dspine::frozen_head_loss", mutates_args=())
def _frozen_head_loss(
    draft_hidden: torch.Tensor,
    head_weight: torch.Tensor,
    labels: torch.Tensor,
    teacher_hidden: torch.Tensor | None,
    ce_scale: torch.Tensor,
    l1_scale: torch.Tensor | None,
    top_k: int,
    chunk_rows: int,
    dtype: torch.dtype,
    want_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chunk loop: (ce, correct, l1, candidate_ids, candidate_probs, dx [R, H] fp32); l1 and the candidates are
    empty ([0]) without a teacher, dx without ``want_grad``."""
    rows = draft_hidden.shape[0]
    has_teacher = teacher_hidden is not None
    device = draft_hidden.device
    results = RowResults(rows, top_k, has_teacher, False, device)
    grad_input = torch.empty(rows, draft_hidden.shape[1], dtype=torch.float32, device=device) if want_grad else None

    fused_grad = want_grad and stats_write_grad(has_teacher, top_k, head_weight.shape[0])
    with torch.autocast(device.type, enabled=False):
        weight = head_weight.to(dtype)
        scales = (ce_scale, l1_scale) if fused_grad else None
        passes = chunk_passes(draft_hidden, teacher_hidden, labels, weight, chunk_rows, top_k, scales)
        for start, end, z, y, stats in passes:
            results.store(start, end, z, y, stats)
            if want_grad and not fused_grad:
                chunk = slice(start, end)
                write_logit_grads(
                    z, y, labels[chunk], ce_scale[chunk], l1_scale[chunk], stats.draft_lse, stats.teacher_lse,
                    stats.sign_mass,
                )  # fmt: skip
            if want_grad:
                _project_grads(z, weight, grad_input[start:end])
    outputs = results.outputs()
    if not has_teacher:
        outputs = (*outputs, *_absent_terms(draft_hidden))
    return *outputs, grad_input if want_grad else draft_hidden.new_empty(0, dtype=torch.float32)


def _absent_terms(like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty l1, candidate ids and candidate probabilities, for the CE-only path."""
    return (
        like.new_empty(0, dtype=torch.float32),
        like.new_empty(0, dtype=torch.int64),
        like.new_empty(0, dtype=torch.float32),
    )


@_frozen_head_loss.register_fake
def _(draft_hidden, head_weight, labels, teacher_hidden, ce_scale, l1_scale, top_k, chunk_rows, dtype, want_grad):
    rows, device = draft_hidden.shape[0], draft_hidden.device
    results = RowResults(rows, top_k, teacher_hidden is not None, False, device)
    outputs = results.outputs()
    if teacher_hidden is None:
        outputs = (*outputs, *_absent_terms(draft_hidden))
    grad_rows = (rows, draft_hidden.shape[1]) if want_grad else (0,)
    return *outputs, torch.empty(grad_rows, dtype=torch.float32, device=device)


class LigerFrozenHeadLossFunction(torch.autograd.Function):
    """``(x [R, H], W [V, H], labels [R], t [R, H] | None, a [R], b [R] | None, K, C, dtype, want_grad)`` ->
    ``(loss, ce, correct[, l1, ids, probs])``; ``want_grad`` says whether to form dx. Only ``loss`` is
    differentiable, and only in x."""

    kernel_ops = ("liger_dspine::frozen_head_loss",)

    @staticmethod
    def forward(
        ctx, draft_hidden, head_weight, labels, teacher_hidden, ce_scale, l1_scale, top_k, chunk_rows, dtype, want_grad
    ):
        has_teacher = teacher_hidden is not None
        ce, correct, l1, ids, probs, grad_input = _frozen_head_loss(
            draft_hidden, head_weight, labels, teacher_hidden, ce_scale, l1_scale, top_k, chunk_rows, dtype, want_grad
        )
        loss = (ce * ce_scale).sum()
        if has_teacher:
            loss = loss + (l1 * l1_scale).sum()
        terms = (ce, correct, l1, ids, probs) if has_teacher else (ce, correct)
        ctx.save_for_backward(grad_input if want_grad else None)
        ctx.input_dtype = draft_hidden.dtype
        ctx.mark_non_differentiable(*terms)
        return (loss, *terms)

    @staticmethod
    @first_order_only
    def backward(ctx, grad_loss, *_unused):
        (grad_input,) = ctx.saved_tensors
        if grad_input is None:
            return (None,) * 10
        out = torch.empty(grad_input.shape, dtype=ctx.input_dtype, device=grad_input.device)
        torch.mul(grad_input, grad_loss.float(), out=out)  # fp32 product, one rounding to the input dtype
        return out, *(None,) * 9


def liger_frozen_head_loss(
    draft_hidden: torch.Tensor,
    head_weight: torch.Tensor,
    labels: torch.Tensor,
    ce_scale: torch.Tensor,
    teacher_hidden: torch.Tensor | None = None,
    l1_scale: torch.Tensor | None = None,
    top_k: int = 0,
    *,
    chunk_rows: int | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> FrozenHeadLoss:
    """sum(ce_scale * ce + l1_scale * l1) over R rows, and the per-row frozen-head terms, in one fused pass.

    Args:
        draft_hidden: [R, H] final-normed draft states (same dtype as ``head_weight`` outside autocast).
        head_weight: [V, H] the frozen target lm_head weight (must not require grad while autograd is on).
        labels: [R] integer target tokens; ``IGNORE_INDEX`` (-100) rows get ce = 0 and no CE gradient.
        ce_scale: [R] weight of each row's CE in the loss (no gradient flows to it).
        teacher_hidden: [R, H] target final states predicting the same tokens, or None for the CE-only path.
        l1_scale: [R] weight of each row's L1 (required with a teacher).
        top_k: K >= 1 when ``teacher_hidden`` is given.
        chunk_rows: rows per chunk; None picks a height whose logits fit ``chunk_bytes`` (:func:`loss_chunk_rows`).
        chunk_bytes: the chunk logits' budget in bytes ([2C, V] in the GEMM dtype with a teacher, [C, V] without).

    Returns:
        :class:`FrozenHeadLoss`: the differentiable scalar and the detached per-row :class:`FrozenHeadTerms`.
    """
    what = "fused frozen head loss"
    dtype = check_inputs(draft_hidden, head_weight, labels, teacher_hidden, top_k, what)
    check_kernel_device(draft_hidden, "the fused frozen-head objective")
    rows, vocab_size = draft_hidden.shape[0], head_weight.shape[0]
    has_teacher = teacher_hidden is not None
    for name, scale in (("ce_scale", ce_scale), ("l1_scale", l1_scale if has_teacher else None)):
        if has_teacher or name == "ce_scale":
            if scale is None or scale.shape != (rows,):
                found = None if scale is None else tuple(scale.shape)
                raise ValueError(f"liger-dspine: {what} expects {name} of shape [{rows}], got {found}")
    device, hidden = draft_hidden.device, draft_hidden.shape[1]
    if chunk_rows is None:
        element_size = torch.empty((), dtype=dtype).element_size()
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0
        chunk_rows = loss_chunk_rows(rows, vocab_size, element_size, has_teacher, chunk_bytes, hidden, sms)
    if chunk_rows < 1:
        raise ValueError(f"liger-dspine: chunk_rows must be >= 1, got {chunk_rows}")
    labels = labels.to(device=device, dtype=torch.int64).contiguous()
    ce_scale = ce_scale.detach().to(device=device, dtype=torch.float32).contiguous()
    if has_teacher:
        teacher_hidden = teacher_hidden.detach()
        l1_scale = l1_scale.detach().to(device=device, dtype=torch.float32).contiguous()
    else:
        l1_scale = None
    want_grad = torch.is_grad_enabled() and draft_hidden.requires_grad
    outputs = LigerFrozenHeadLossFunction.apply(
        draft_hidden,
        head_weight,
        labels,
        teacher_hidden,
        ce_scale,
        l1_scale,
        int(top_k),
        int(chunk_rows),
        dtype,
        want_grad,
    )
    return FrozenHeadLoss(outputs[0], FrozenHeadTerms(*outputs[1:]))
