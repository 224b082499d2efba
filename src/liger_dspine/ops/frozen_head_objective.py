"""The frozen-head terms of the DSpine objective (backbone CE, L1 to the teacher, top-k candidates), fused.

Same contract as the eager :func:`liger_dspine.models.dspine.frozen_head_terms.frozen_head_terms`: given draft rows
x [R, H], teacher rows t [R, H] and the frozen head W [V, H], per row

    z = x W^T, p = softmax(z);  y = t W^T, q = softmax(y)
    ce = logsumexp(z) - z[label];  correct = argmax(z) == label
    l1 = sum_v |p_v - q_v|;  candidate_ids = topk(z, K);  candidate_teacher_probs = q[candidate_ids]

with gradients only to x (through ce and l1). It never holds [R, V] logits: rows go in chunks of C, where
C = next_pow2(ceil(R / ceil(V / H))) as in liger-kernel's fused linear cross entropy, so a chunk's logits are
about as large as x itself. Nothing of size V is saved for the backward.

Forward, per chunk: z and y by cuBLAS (in the rows' dtype, as ``F.linear`` does); one Triton program per row makes
two passes over its V logits: (1) online max / sum-exp of z and y, the first argmax of z and z[label];
(2) l1 = sum |p - q| and S = sum p * sign(p - q). The top-k runs on the chunk's z (``torch.topk``), and the
teacher probabilities at the candidates are exp(y - logsumexp(y)). Saved per row: logsumexp(z), logsumexp(y), S.

Backward, per chunk: z and y are recomputed; one Triton program per row writes, in place of z,

    dz = g_ce * (p - onehot(label)) + g_l1 * p * (s - S),   s = sign(p - q)

(d l1 / d z_j = sum_v s_v p_v (delta_vj - p_j) = p_j (s_j - S)), then dx = dz W. dz is rounded to the rows' dtype
before that GEMM, as the eager backward of ``.float()`` does. W gets no gradient and no fp32 accumulator.

Why recompute rather than compute dx in the forward (as liger's fused CE does): that needs two [C, V] x [V, H]
GEMMs in the forward (one for the CE part, one for the L1 part, since g_ce and g_l1 are only known in the
backward), which costs more than recomputing when the caller checkpoints (DSpine's objective does: its chunk
forward runs twice), and it would hold two [R, H] gradients between forward and backward.

Differences from the eager function (both where eager is undefined or arbitrary):
- Labels equal to ``IGNORE_INDEX`` (-100) give ce = 0, correct = False and no CE gradient (eager raises on them);
  l1 and the candidates of such rows are computed as usual. Other labels must lie in [0, V) (checked on device).
- sign(p - q) is 0 where p == q, as torch's ``abs`` gradient, with p and q computed by the same formula here, so
  a teacher row equal to its draft row gives l1 = 0 and no L1 gradient. Eager computes p as exp(log_softmax) and
  q as softmax, whose last-bit differences give that case arbitrary signs.
- Tied logits: ``correct`` uses the first maximal index, as ``torch.argmax``; the order of tied candidates is
  whatever ``torch.topk`` gives.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from liger_dspine._interpreter import check_kernel_device
from liger_dspine.models.dspine.frozen_head_terms import FrozenHeadTerms
from liger_dspine.ops.gemm_dtype import gemm_dtype

IGNORE_INDEX = -100
_MAX_BLOCK_V = 4096
_NUM_WARPS = 8


@triton.jit
def _frozen_head_forward_kernel(
    draft_logits_ptr,  # [C, V] float, contiguous
    teacher_logits_ptr,  # [C, V] float, contiguous (unused without a teacher)
    labels_ptr,  # [C] int64
    ce_ptr,  # [C] fp32 out
    correct_ptr,  # [C] int8 out
    l1_ptr,  # [C] fp32 out
    draft_lse_ptr,  # [C] fp32 out
    teacher_lse_ptr,  # [C] fp32 out
    sign_mass_ptr,  # [C] fp32 out: S = sum_v p_v * sign(p_v - q_v)
    vocab_size,
    ignore_index,
    HAS_TEACHER: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    draft_row = draft_logits_ptr + row * vocab_size
    teacher_row = teacher_logits_ptr + row * vocab_size
    cols = tl.arange(0, BLOCK_V)

    # Pass 1: normalisers (online max / sum-exp) and the first argmax of the draft.
    draft_max = float("-inf")
    draft_sum = 0.0
    best = 0
    teacher_max = float("-inf")
    teacher_sum = 0.0
    for start in range(0, vocab_size, BLOCK_V):
        offsets = start + cols
        in_row = offsets < vocab_size
        z = tl.load(draft_row + offsets, mask=in_row, other=float("-inf")).to(tl.float32)
        block_max = tl.max(z, axis=0)
        block_best = start + tl.argmax(z, axis=0, tie_break_left=True)
        best = tl.where(block_max > draft_max, block_best, best)  # strict: earlier blocks win ties
        new_max = tl.maximum(draft_max, block_max)
        draft_sum = draft_sum * tl.exp(draft_max - new_max) + tl.sum(tl.exp(z - new_max), axis=0)
        draft_max = new_max
        if HAS_TEACHER:
            y = tl.load(teacher_row + offsets, mask=in_row, other=float("-inf")).to(tl.float32)
            new_teacher_max = tl.maximum(teacher_max, tl.max(y, axis=0))
            teacher_sum = teacher_sum * tl.exp(teacher_max - new_teacher_max) + tl.sum(
                tl.exp(y - new_teacher_max), axis=0
            )
            teacher_max = new_teacher_max
    draft_lse = draft_max + tl.log(draft_sum)

    label = tl.load(labels_ptr + row)
    labelled = label != ignore_index
    safe_label = tl.where(labelled, label, 0)
    label_logit = tl.load(draft_row + safe_label).to(tl.float32)
    tl.store(ce_ptr + row, tl.where(labelled, draft_lse - label_logit, 0.0))
    tl.store(correct_ptr + row, (labelled & (best == safe_label)).to(tl.int8))
    tl.store(draft_lse_ptr + row, draft_lse)

    if HAS_TEACHER:
        teacher_lse = teacher_max + tl.log(teacher_sum)
        # Pass 2: the L1 distance and the sign mass S the backward needs.
        l1 = 0.0
        sign_mass = 0.0
        for start in range(0, vocab_size, BLOCK_V):
            offsets = start + cols
            in_row = offsets < vocab_size
            z = tl.load(draft_row + offsets, mask=in_row, other=float("-inf")).to(tl.float32)
            y = tl.load(teacher_row + offsets, mask=in_row, other=float("-inf")).to(tl.float32)
            p = tl.exp(z - draft_lse)
            diff = p - tl.exp(y - teacher_lse)
            sign = tl.where(diff > 0, 1.0, tl.where(diff < 0, -1.0, 0.0))
            l1 += tl.sum(tl.abs(diff), axis=0)
            sign_mass += tl.sum(p * sign, axis=0)
        tl.store(l1_ptr + row, l1)
        tl.store(teacher_lse_ptr + row, teacher_lse)
        tl.store(sign_mass_ptr + row, sign_mass)


@triton.jit
def _frozen_head_backward_kernel(
    draft_logits_ptr,  # [C, V] float, contiguous: overwritten with d loss / d z
    teacher_logits_ptr,  # [C, V] float, contiguous (unused without a teacher)
    labels_ptr,  # [C] int64
    grad_ce_ptr,  # [C] fp32
    grad_l1_ptr,  # [C] fp32 (unused without a teacher)
    draft_lse_ptr,  # [C] fp32
    teacher_lse_ptr,  # [C] fp32
    sign_mass_ptr,  # [C] fp32
    vocab_size,
    ignore_index,
    HAS_TEACHER: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    draft_row = draft_logits_ptr + row * vocab_size
    teacher_row = teacher_logits_ptr + row * vocab_size
    cols = tl.arange(0, BLOCK_V)

    label = tl.load(labels_ptr + row)
    grad_ce = tl.where(label != ignore_index, tl.load(grad_ce_ptr + row), 0.0)
    draft_lse = tl.load(draft_lse_ptr + row)
    if HAS_TEACHER:
        grad_l1 = tl.load(grad_l1_ptr + row)
        teacher_lse = tl.load(teacher_lse_ptr + row)
        sign_mass = tl.load(sign_mass_ptr + row)
    for start in range(0, vocab_size, BLOCK_V):
        offsets = start + cols
        in_row = offsets < vocab_size
        z = tl.load(draft_row + offsets, mask=in_row, other=float("-inf")).to(tl.float32)
        p = tl.exp(z - draft_lse)
        grad = grad_ce * (p - tl.where(offsets == label, 1.0, 0.0))
        if HAS_TEACHER:
            y = tl.load(teacher_row + offsets, mask=in_row, other=float("-inf")).to(tl.float32)
            diff = p - tl.exp(y - teacher_lse)
            sign = tl.where(diff > 0, 1.0, tl.where(diff < 0, -1.0, 0.0))
            grad += grad_l1 * p * (sign - sign_mass)
        tl.store(draft_row + offsets, grad.to(draft_logits_ptr.dtype.element_ty), mask=in_row)


def default_chunk_rows(rows: int, hidden_size: int, vocab_size: int) -> int:
    """Rows per chunk such that chunk x V is about R x H (liger-kernel's fused linear cross entropy rule)."""
    growth = triton.cdiv(vocab_size, hidden_size)
    return max(1, min(rows, triton.next_power_of_2(triton.cdiv(rows, growth))))


def _block_v(vocab_size: int) -> int:
    return min(_MAX_BLOCK_V, triton.next_power_of_2(vocab_size))


def _chunk_logits(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[C, H] x [V, H] -> [C, V] contiguous logits in the weight's dtype."""
    return F.linear(rows.to(weight.dtype), weight).contiguous()


class FusedFrozenHeadTermsFunction(torch.autograd.Function):
    """``(x [R, H], W [V, H], labels [R], t [R, H] | None, K, C)`` -> ``(ce, correct[, l1, ids, teacher probs])``.

    Outputs: ce [R] fp32, correct [R] bool; with a teacher also l1 [R] fp32, candidate_ids [R, K] int64 and
    candidate_teacher_probs [R, K] fp32. Only ce and l1 are differentiable, and only with respect to x.
    """

    @staticmethod
    def forward(ctx, draft_hidden, head_weight, labels, teacher_hidden, top_k, chunk_rows):
        rows = draft_hidden.shape[0]
        vocab_size = head_weight.shape[0]
        has_teacher = teacher_hidden is not None
        device = draft_hidden.device
        dtype = gemm_dtype(draft_hidden, head_weight, "frozen head terms")
        ce = torch.empty(rows, dtype=torch.float32, device=device)
        correct = torch.empty(rows, dtype=torch.int8, device=device)
        draft_lse = torch.empty_like(ce)
        l1 = teacher_lse = sign_mass = candidate_ids = candidate_probs = None
        if has_teacher:
            l1, teacher_lse, sign_mass = torch.empty_like(ce), torch.empty_like(ce), torch.empty_like(ce)
            candidate_ids = torch.empty(rows, top_k, dtype=torch.int64, device=device)
            candidate_probs = torch.empty(rows, top_k, dtype=torch.float32, device=device)

        with torch.autocast(device.type, enabled=False):
            weight = head_weight.to(dtype)
            for start in range(0, rows, chunk_rows):
                end = min(start + chunk_rows, rows)
                draft_logits = _chunk_logits(draft_hidden[start:end], weight)
                teacher_logits = _chunk_logits(teacher_hidden[start:end], weight) if has_teacher else draft_logits
                _frozen_head_forward_kernel[(end - start,)](
                    draft_logits,
                    teacher_logits,
                    labels[start:end],
                    ce[start:end],
                    correct[start:end],
                    l1[start:end] if has_teacher else ce,
                    draft_lse[start:end],
                    teacher_lse[start:end] if has_teacher else ce,
                    sign_mass[start:end] if has_teacher else ce,
                    vocab_size,
                    IGNORE_INDEX,
                    HAS_TEACHER=has_teacher,
                    BLOCK_V=_block_v(vocab_size),
                    num_warps=_NUM_WARPS,
                )
                if has_teacher:
                    ids = torch.topk(draft_logits, top_k, dim=-1).indices
                    candidate_ids[start:end] = ids
                    picked = teacher_logits.gather(-1, ids).float()
                    candidate_probs[start:end] = torch.exp(picked - teacher_lse[start:end, None])

        correct = correct.bool()
        ctx.has_teacher = has_teacher
        ctx.chunk_rows = chunk_rows
        ctx.compute_dtype = dtype
        ctx.save_for_backward(draft_hidden, head_weight, labels, teacher_hidden, draft_lse, teacher_lse, sign_mass)
        if not has_teacher:
            ctx.mark_non_differentiable(correct)
            return ce, correct
        ctx.mark_non_differentiable(correct, candidate_ids, candidate_probs)
        return ce, correct, l1, candidate_ids, candidate_probs

    @staticmethod
    def backward(ctx, grad_ce, _grad_correct, grad_l1=None, _grad_ids=None, _grad_probs=None):
        draft_hidden, head_weight, labels, teacher_hidden, draft_lse, teacher_lse, sign_mass = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None, None
        has_teacher = ctx.has_teacher
        rows = draft_hidden.shape[0]
        vocab_size = head_weight.shape[0]
        grad_ce = grad_ce.float().contiguous()
        grad_l1 = grad_l1.float().contiguous() if has_teacher else grad_ce
        grad_input = torch.empty_like(draft_hidden, memory_format=torch.contiguous_format)
        with torch.autocast(draft_hidden.device.type, enabled=False):
            weight = head_weight.to(ctx.compute_dtype)
            for start in range(0, rows, ctx.chunk_rows):
                end = min(start + ctx.chunk_rows, rows)
                grad_logits = _chunk_logits(draft_hidden[start:end], weight)
                teacher_logits = _chunk_logits(teacher_hidden[start:end], weight) if has_teacher else grad_logits
                _frozen_head_backward_kernel[(end - start,)](
                    grad_logits,
                    teacher_logits,
                    labels[start:end],
                    grad_ce[start:end],
                    grad_l1[start:end],
                    draft_lse[start:end],
                    teacher_lse[start:end] if has_teacher else draft_lse,
                    sign_mass[start:end] if has_teacher else draft_lse,
                    vocab_size,
                    IGNORE_INDEX,
                    HAS_TEACHER=has_teacher,
                    BLOCK_V=_block_v(vocab_size),
                    num_warps=_NUM_WARPS,
                )
                if grad_input.dtype == weight.dtype:
                    torch.mm(grad_logits, weight, out=grad_input[start:end])
                else:
                    grad_input[start:end] = grad_logits.mm(weight)
        return grad_input, None, None, None, None, None


def _check_inputs(draft_hidden, head_weight, labels, teacher_hidden, top_k):
    if draft_hidden.dim() != 2 or head_weight.dim() != 2 or draft_hidden.shape[1] != head_weight.shape[1]:
        raise ValueError(
            f"frozen head terms expect draft rows [R, H] and a head [V, H], got {tuple(draft_hidden.shape)} and "
            f"{tuple(head_weight.shape)}"
        )
    rows, vocab_size = draft_hidden.shape[0], head_weight.shape[0]
    if labels.shape != (rows,):
        raise ValueError(f"frozen head terms expect labels [{rows}], got {tuple(labels.shape)}")
    if teacher_hidden is not None:
        if teacher_hidden.shape != draft_hidden.shape:
            raise ValueError(
                f"teacher rows {tuple(teacher_hidden.shape)} differ from draft rows {tuple(draft_hidden.shape)}"
            )
        if top_k < 1:
            raise ValueError(f"frozen_head_terms needs top_k >= 1 with a teacher, got {top_k}")
        if top_k > vocab_size:
            raise ValueError(f"top_k={top_k} exceeds the vocabulary ({vocab_size})")
    if torch.is_grad_enabled() and head_weight.requires_grad:
        raise ValueError(
            "the fused frozen head terms give the head no gradient; freeze it (head_weight.requires_grad_(False)) "
            "or use the eager frozen_head_terms"
        )


def fused_frozen_head_terms(
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
    _check_inputs(draft_hidden, head_weight, labels, teacher_hidden, top_k)
    check_kernel_device(draft_hidden, "the fused frozen-head objective")
    rows, vocab_size = draft_hidden.shape[0], head_weight.shape[0]
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(rows, head_weight.shape[1], vocab_size)
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    labels = labels.to(device=draft_hidden.device, dtype=torch.int64).contiguous()
    torch._assert_async(((labels == IGNORE_INDEX) | ((labels >= 0) & (labels < vocab_size))).all())
    if teacher_hidden is not None:
        teacher_hidden = teacher_hidden.detach()
    outputs = FusedFrozenHeadTermsFunction.apply(
        draft_hidden, head_weight, labels, teacher_hidden, int(top_k), int(chunk_rows)
    )
    return FrozenHeadTerms(*outputs)
