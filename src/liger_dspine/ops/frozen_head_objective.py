"""The frozen-head terms of the DSpine objective (backbone CE, L1 to the teacher, top-k candidates), fused.

Same contract as the eager :func:`liger_dspine.models.dspine.frozen_head_terms.frozen_head_terms`: given draft rows
x [R, H], teacher rows t [R, H] and the frozen head W [V, H], per row

    z = x W^T, p = softmax(z);  y = t W^T, q = softmax(y)
    ce = logsumexp(z) - z[label];  correct = argmax(z) == label
    l1 = sum_v |p_v - q_v|;  candidate_ids = topk(z, K);  candidate_teacher_probs = q[candidate_ids]

with gradients only to x, through ce and l1, each with a gradient of its own. It never holds [R, V] logits: rows go
in chunks (:func:`default_chunk_rows`), and nothing of size V is saved for the backward, which recomputes each
chunk's logits (see :mod:`liger_dspine.ops.frozen_head_kernels` for the passes). When the caller only needs the
weighted sum of ce and l1, :func:`liger_dspine.ops.frozen_head_loss.liger_frozen_head_loss` is cheaper: it forms the
input gradient in its forward and recomputes nothing.

Differences from the eager function (both where eager is undefined or arbitrary):
- Labels equal to ``IGNORE_INDEX`` (-100) give ce = 0, correct = False and no CE gradient (eager raises on them);
  l1 and the candidates of such rows are computed as usual. Other labels must lie in [0, V) (a ValueError names the
  first that does not).
- sign(p - q) is 0 where p == q, as torch's ``abs`` gradient, with p and q computed by the same formula here, so
  a teacher row equal to its draft row gives l1 = 0 and no L1 gradient. Eager computes p as exp(log_softmax) and
  q as softmax, whose last-bit differences give that case arbitrary signs.
- Tied logits: ``correct`` uses the first maximal index, as ``torch.argmax``; candidates tied on their logit may
  come in another order than eager's, and a tie at the K-th place may pick another of the tied ids.
- A row with a NaN logit gets NaN ce (and l1, with a teacher), as eager; its ``correct`` and candidates are
  unspecified (eager's ``argmax`` and ``topk`` rank NaN first, the kernel's maxima may not).
"""

import torch

from liger_dspine._interpreter import check_kernel_device
from liger_dspine.ops.eager_dispatch import liger_custom_op
from liger_dspine.ops.first_order import first_order_only
from liger_dspine.ops.frozen_head_kernels import IGNORE_INDEX
from liger_dspine.ops.frozen_head_kernels import RowResults
from liger_dspine.ops.frozen_head_kernels import check_inputs
from liger_dspine.ops.frozen_head_kernels import chunk_logit_passes
from liger_dspine.ops.frozen_head_kernels import chunk_passes
from liger_dspine.ops.frozen_head_kernels import default_chunk_rows
from liger_dspine.ops.frozen_head_kernels import write_logit_grads
from liger_dspine.ops.frozen_head_results import FrozenHeadTerms

__all__ = ["IGNORE_INDEX", "default_chunk_rows", "liger_frozen_head_terms", "LigerFrozenHeadTermsFunction"]


@liger_custom_op("liger_dspine::frozen_head_terms", mutates_args=())
def _frozen_head_terms(
    draft_hidden: torch.Tensor,
    head_weight: torch.Tensor,
    labels: torch.Tensor,
    teacher_hidden: torch.Tensor | None,
    top_k: int,
    chunk_rows: int,
    dtype: torch.dtype,
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]:
    """The forward's chunk loop: (ce, correct, l1, candidate_ids, candidate_probs, draft_lse, teacher_lse,
    sign_mass); the teacher's five are empty ([0]) without a teacher."""
    results = RowResults(draft_hidden.shape[0], top_k, teacher_hidden is not None, True, draft_hidden.device)
    with torch.autocast(draft_hidden.device.type, enabled=False):
        weight = head_weight.to(dtype)
        for start, end, z, y, stats in chunk_passes(draft_hidden, teacher_hidden, labels, weight, chunk_rows, top_k):
            results.store(start, end, z, y, stats)
    return _terms_outputs(results, draft_hidden)


def _terms_outputs(results: RowResults, like: torch.Tensor) -> tuple:
    def present(t, dtype=torch.float32):
        return like.new_empty(0, dtype=dtype) if t is None else t

    return (
        results.ce,
        results.correct,
        present(results.l1),
        present(results.candidate_ids, torch.int64),
        present(results.candidate_probs),
        results.draft_lse,
        present(results.teacher_lse),
        present(results.sign_mass),
    )


@_frozen_head_terms.register_fake
def _(draft_hidden, head_weight, labels, teacher_hidden, top_k, chunk_rows, dtype):
    results = RowResults(draft_hidden.shape[0], top_k, teacher_hidden is not None, True, draft_hidden.device)
    return _terms_outputs(results, draft_hidden)


@liger_custom_op("liger_dspine::frozen_head_terms_backward", mutates_args=())
def _frozen_head_terms_backward(
    draft_hidden: torch.Tensor,
    head_weight: torch.Tensor,
    labels: torch.Tensor,
    teacher_hidden: torch.Tensor | None,
    draft_lse: torch.Tensor,
    teacher_lse: torch.Tensor,
    sign_mass: torch.Tensor,
    grad_ce: torch.Tensor,
    grad_l1: torch.Tensor,
    chunk_rows: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """d x [R, H] in x's dtype, recomputing each chunk's logits."""
    has_teacher = teacher_hidden is not None
    grad_input = torch.empty_like(draft_hidden, memory_format=torch.contiguous_format)
    with torch.autocast(draft_hidden.device.type, enabled=False):
        weight = head_weight.to(dtype)
        for start, end, z, y in chunk_logit_passes(draft_hidden, teacher_hidden, weight, chunk_rows):
            rows = slice(start, end)
            write_logit_grads(
                z,
                y,
                labels[rows],
                grad_ce[rows],
                grad_l1[rows],
                draft_lse[rows],
                teacher_lse[rows] if has_teacher else None,
                sign_mass[rows] if has_teacher else None,
            )
            if grad_input.dtype == weight.dtype:
                torch.mm(z, weight, out=grad_input[rows])
            else:
                grad_input[rows] = z.mm(weight)
    return grad_input


@_frozen_head_terms_backward.register_fake
def _(draft_hidden, *_):
    return torch.empty_like(draft_hidden, memory_format=torch.contiguous_format)


class LigerFrozenHeadTermsFunction(torch.autograd.Function):
    """``(x [R, H], W [V, H], labels [R], t [R, H] | None, K, C, dtype)`` -> ``(ce, correct[, l1, ids, probs])``.

    Outputs: ce [R] fp32, correct [R] bool; with a teacher also l1 [R] fp32, candidate_ids [R, K] int64 and
    candidate_teacher_probs [R, K] fp32. Only ce and l1 are differentiable, and only with respect to x.
    """

    kernel_ops = ("liger_dspine::frozen_head_terms", "liger_dspine::frozen_head_terms_backward")

    @staticmethod
    def forward(ctx, draft_hidden, head_weight, labels, teacher_hidden, top_k, chunk_rows, dtype):
        has_teacher = teacher_hidden is not None
        ce, correct, l1, ids, probs, draft_lse, teacher_lse, sign_mass = _frozen_head_terms(
            draft_hidden, head_weight, labels, teacher_hidden, top_k, chunk_rows, dtype
        )
        ctx.has_teacher = has_teacher
        ctx.chunk_rows = chunk_rows
        ctx.compute_dtype = dtype
        ctx.save_for_backward(draft_hidden, head_weight, labels, teacher_hidden, draft_lse, teacher_lse, sign_mass)
        if not has_teacher:
            ctx.mark_non_differentiable(correct)
            return ce, correct
        ctx.mark_non_differentiable(correct, ids, probs)
        return ce, correct, l1, ids, probs

    @staticmethod
    @first_order_only
    def backward(ctx, grad_ce, _grad_correct, grad_l1=None, _grad_ids=None, _grad_probs=None):
        draft_hidden, head_weight, labels, teacher_hidden, draft_lse, teacher_lse, sign_mass = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None, None, None
        grad_ce = grad_ce.float().contiguous()
        has_l1 = ctx.has_teacher and grad_l1 is not None
        grad_l1 = grad_l1.float().contiguous() if has_l1 else torch.zeros_like(grad_ce)
        grad_input = _frozen_head_terms_backward(
            draft_hidden, head_weight, labels, teacher_hidden, draft_lse, teacher_lse, sign_mass, grad_ce, grad_l1,
            ctx.chunk_rows, ctx.compute_dtype,
        )  # fmt: skip
        return grad_input, None, None, None, None, None, None


def liger_frozen_head_terms(
    draft_hidden: torch.Tensor,
    head_weight: torch.Tensor,
    labels: torch.Tensor,
    teacher_hidden: torch.Tensor | None = None,
    top_k: int = 0,
    *,
    chunk_rows: int | None = None,
) -> FrozenHeadTerms:
    """Per-row CE, L1 to the teacher, top-k candidates and teacher candidate probabilities, chunked and fused.

    Args:
        draft_hidden: [R, H] final-normed draft states (any float dtype; same as ``head_weight`` outside autocast).
        head_weight: [V, H] the frozen target lm_head weight (must not require grad while autograd is on).
        labels: [R] integer target tokens; ``IGNORE_INDEX`` (-100) rows get ce = 0 and no CE gradient.
        teacher_hidden: [R, H] target final states predicting the same tokens (no gradient), or None for the
            CE-only path (no teacher projection, no L1, no top-k).
        top_k: K >= 1 when ``teacher_hidden`` is given.
        chunk_rows: rows per chunk; None picks :func:`default_chunk_rows`. Results do not depend on it.

    Returns:
        :class:`FrozenHeadTerms`, as the eager ``frozen_head_terms``.
    """
    what = "fused frozen head terms"
    dtype = check_inputs(draft_hidden, head_weight, labels, teacher_hidden, top_k, what)
    check_kernel_device(draft_hidden, "the fused frozen-head objective")
    rows, vocab_size = draft_hidden.shape[0], head_weight.shape[0]
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(rows, head_weight.shape[1], vocab_size)
    if chunk_rows < 1:
        raise ValueError(f"liger-dspine: chunk_rows must be >= 1, got {chunk_rows}")
    labels = labels.to(device=draft_hidden.device, dtype=torch.int64).contiguous()
    if teacher_hidden is not None:
        teacher_hidden = teacher_hidden.detach()
    outputs = LigerFrozenHeadTermsFunction.apply(
        draft_hidden, head_weight, labels, teacher_hidden, int(top_k), int(chunk_rows), dtype
    )
    return FrozenHeadTerms(*outputs)
