"""The DSpine refinement loss over each proposal's K candidates, in two kernel launches forward and two backward.

Per row n, with s[n, k] = W[ids[n, k]] . h[n] (the candidate scores of :mod:`liger_dspine.ops.candidate_scores`),
q = softmax(s), the teacher's candidate probabilities p and mass = sum_k p[k], t = p / max(mass, 1e-30):

    ref[n] = a * refCE + (1 - a) * refL1,  refCE = -sum_k [ids[k] == label] log q[k],
    refL1 = sum_k |q[k] - t[k]| if mass > threshold else 0,

with a = ``ce_weight``; ``covered[n]`` says whether the label is a candidate. Written in torch (as
:func:`~liger_dspine.models.dspine.objective.refinement_terms` does) this is about 20 small element-wise kernels
forward and 25 backward per chunk of rows, and a chunked, checkpointed objective runs the forward twice; at the
objective's widths the GPU waits for the host to launch them. Here one kernel takes the scores to ``ref``,
``covered`` and the gradient of ``ref`` with respect to the scores (for an upstream gradient of 1, N x K fp32,
kept for the backward): with c = sum_k hit[k] and sigma = sign(q - t) (0 at 0, as ``abs``'s gradient),

    d ref / d s[j] = a (q[j] c - hit[j]) + (1 - a) [mass > threshold] q[j] (sigma[j] - sum_k sigma[k] q[k]).

The backward scales it by the rows' upstream gradient into a new tensor (a retained graph gives the same gradient on
every pass) and runs the candidate scores' backward, dh = sum_k ds[k] W[ids[k]]. Without a Triton device (CPU
without the interpreter, or fp64) the same formulas run in torch.
"""

import torch
import triton
import triton.language as tl

from liger_dspine.ops import candidate_scores
from liger_dspine.ops.eager_dispatch import liger_custom_op
from liger_dspine.ops.first_order import first_order_only

_BLOCK_ROWS = 64


@triton.jit
def _refinement_loss_kernel(
    scores_ptr,  # [N, K] fp32
    probs_ptr,  # [N, K] fp32
    ids_ptr,  # [N, K] int64
    labels_ptr,  # [N] int64
    ref_ptr,  # [N] fp32 out
    covered_ptr,  # [N] bool out
    unit_grad_ptr,  # [N, K] fp32 out
    rows,
    top_k,
    ce_weight,
    mass_threshold,
    K_PAD: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    ks = tl.arange(0, K_PAD)
    in_row = row < rows
    inside = in_row[:, None] & (ks < top_k)[None, :]
    offsets = row[:, None] * top_k + ks[None, :]
    scores = tl.load(scores_ptr + offsets, mask=inside, other=float("-inf"))
    probs = tl.load(probs_ptr + offsets, mask=inside, other=0.0)
    ids = tl.load(ids_ptr + offsets, mask=inside, other=0)
    labels = tl.load(labels_ptr + row, mask=in_row, other=0)

    top = tl.max(tl.where(inside, scores, float("-inf")), axis=1)
    top = tl.where(in_row, top, 0.0)
    shifted = scores - top[:, None]
    exps = tl.where(inside, tl.exp(shifted), 0.0)
    total = tl.sum(exps, axis=1)
    total = tl.where(in_row, total, 1.0)
    log_q = shifted - tl.log(total)[:, None]
    q = tl.where(inside, tl.exp(log_q), 0.0)

    mass = tl.sum(probs, axis=1)
    teacher = probs / tl.maximum(mass, 1e-30)[:, None]
    hit = inside & (ids == labels[:, None])
    hits = tl.sum(hit.to(tl.float32), axis=1)
    ref_ce = -tl.sum(tl.where(hit, log_q, 0.0), axis=1)
    use_l1 = (mass > mass_threshold).to(tl.float32)
    diff = q - teacher
    ref_l1 = tl.sum(tl.where(inside, tl.abs(diff), 0.0), axis=1) * use_l1
    tl.store(ref_ptr + row, ce_weight * ref_ce + (1.0 - ce_weight) * ref_l1, mask=in_row)
    tl.store(covered_ptr + row, hits > 0, mask=in_row)

    sign = tl.where(diff > 0, 1.0, tl.where(diff < 0, -1.0, 0.0))
    sign = tl.where(inside, sign, 0.0)
    signed_mass = tl.sum(sign * q, axis=1)
    grad = ce_weight * (q * hits[:, None] - hit.to(tl.float32))
    grad += (1.0 - ce_weight) * use_l1[:, None] * q * (sign - signed_mass[:, None])
    tl.store(unit_grad_ptr + offsets, grad, mask=inside)


def _terms_torch(scores, probs, ids, labels, ce_weight: float, mass_threshold: float):
    """The kernel's formulas in torch: (ref [N], covered [N] bool, unit_grad [N, K]) in the scores' dtype."""
    log_q = torch.log_softmax(scores, dim=-1)
    q = log_q.exp()
    mass = probs.sum(dim=-1)
    teacher = probs / mass.clamp_min(1e-30)[:, None]
    hit = ids == labels[:, None]
    hit_f = hit.to(scores.dtype)
    use_l1 = (mass > mass_threshold).to(scores.dtype)
    diff = q - teacher
    ref = ce_weight * -(log_q * hit_f).sum(dim=-1) + (1.0 - ce_weight) * diff.abs().sum(dim=-1) * use_l1
    sign = diff.sign()
    grad = ce_weight * (q * hit_f.sum(dim=-1, keepdim=True) - hit_f)
    grad = grad + (1.0 - ce_weight) * use_l1[:, None] * q * (sign - (sign * q).sum(dim=-1, keepdim=True))
    return ref, hit.any(dim=-1), grad


@liger_custom_op("liger_dspine::refinement_loss", mutates_args=())
def _refinement_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    probs: torch.Tensor,
    labels: torch.Tensor,
    ce_weight: float,
    mass_threshold: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ref [N] fp32, covered [N] bool, unit_grad [N, K] fp32) of rows [N, H], the head [V, H], ids [N, K] int64,
    teacher probabilities [N, K] fp32 and labels [N] int64 (all contiguous)."""
    rows, top_k = ids.shape
    scores = candidate_scores._candidate_scores(hidden, weight, ids)
    if not candidate_scores._use_kernel(hidden, weight):
        ref, covered, grad = _terms_torch(scores, probs.to(scores.dtype), ids, labels, ce_weight, mass_threshold)
        return ref, covered, grad
    ref = torch.empty(rows, dtype=torch.float32, device=hidden.device)
    covered = torch.empty(rows, dtype=torch.bool, device=hidden.device)
    grad = torch.empty(rows, top_k, dtype=torch.float32, device=hidden.device)
    if rows:
        _refinement_loss_kernel[(triton.cdiv(rows, _BLOCK_ROWS),)](
            scores, probs, ids, labels, ref, covered, grad, rows, top_k, float(ce_weight), float(mass_threshold),
            K_PAD=triton.next_power_of_2(top_k), BLOCK_ROWS=_BLOCK_ROWS,
        )  # fmt: skip
    return ref, covered, grad


@_refinement_loss.register_fake
def _(hidden, weight, ids, probs, labels, ce_weight, mass_threshold):
    rows = ids.shape[0]
    return (
        torch.empty(rows, dtype=torch.float32, device=hidden.device),
        torch.empty(rows, dtype=torch.bool, device=hidden.device),
        torch.empty(ids.shape, dtype=torch.float32, device=hidden.device),
    )


class LigerRefinementLossFunction(torch.autograd.Function):
    """``(h [N, H], W [V, H], ids [N, K], probs [N, K], labels [N], ce_weight, mass_threshold)`` ->
    (ref [N] fp32, covered [N] bool); differentiable in h only."""

    kernel_ops = (
        "liger_dspine::refinement_loss",
        "liger_dspine::candidate_scores",
        "liger_dspine::candidate_scores_backward",
    )

    @staticmethod
    def forward(ctx, hidden, weight, ids, probs, labels, ce_weight, mass_threshold):
        ref, covered, unit_grad = _refinement_loss(hidden, weight, ids, probs, labels, ce_weight, mass_threshold)
        ctx.save_for_backward(weight, ids, unit_grad)
        ctx.hidden_dtype = hidden.dtype
        ctx.use_kernel = candidate_scores._use_kernel(hidden, weight)
        ctx.mark_non_differentiable(covered)
        return ref, covered

    @staticmethod
    @first_order_only
    def backward(ctx, grad_ref, _grad_covered):
        weight, ids, unit_grad = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return (None,) * 7
        grad_scores = unit_grad * grad_ref.float()[:, None]  # a new [N, K] fp32 tensor
        grad_hidden = candidate_scores._candidate_scores_backward(
            grad_scores, weight, ids, ctx.hidden_dtype, ctx.use_kernel
        )
        return grad_hidden, None, None, None, None, None, None


def liger_refinement_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    probs: torch.Tensor,
    labels: torch.Tensor,
    ce_weight: float,
    mass_threshold: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The refinement loss of rows ``hidden [..., H]`` over candidates ``ids [..., K]`` of the frozen head
    ``weight [V, H]``, the teacher's candidate probabilities ``probs [..., K]`` and ``labels [...]``.

    Returns:
        ref [...] fp32 (differentiable in ``hidden``) and covered [...] bool (the label is a candidate).
    """
    lead = ids.shape[:-1]
    if (
        weight.dim() != 2
        or hidden.shape[-1] != weight.shape[1]
        or hidden.shape[:-1] != lead
        or probs.shape != ids.shape
        or labels.shape != lead
    ):
        raise ValueError(
            f"liger-dspine: the refinement loss expects rows [..., H], a head [V, H], ids and probabilities "
            f"[..., K] and labels [...], got {tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(ids.shape)}, "
            f"{tuple(probs.shape)} and {tuple(labels.shape)}"
        )
    if torch.is_grad_enabled() and weight.requires_grad:
        raise ValueError("liger-dspine: the refinement loss gives the head no gradient; freeze it")
    top_k = ids.shape[-1]
    ref, covered = LigerRefinementLossFunction.apply(
        hidden.reshape(-1, hidden.shape[-1]).contiguous(),
        weight.contiguous(),
        ids.reshape(-1, top_k).to(torch.int64).contiguous(),
        probs.detach().reshape(-1, top_k).float().contiguous(),
        labels.reshape(-1).to(torch.int64).contiguous(),
        float(ce_weight),
        float(mass_threshold),
    )
    return ref.view(lead), covered.view(lead)
