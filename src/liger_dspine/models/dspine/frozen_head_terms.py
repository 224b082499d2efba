"""The per-row "frozen head" part of the DSpine objective, in one function.

Given R draft rows, R teacher rows and the frozen vocabulary projection W [V, H], it computes per row the backbone
cross entropy, the L1 distance between the draft and teacher distributions, the draft's top-k candidates and the
teacher probabilities at those candidates (what the refinement loss needs). Only the draft rows get gradients
(through ``ce`` and ``l1``); W and the teacher are constants.

This eager version materialises [R, V] fp32 logits for the rows it is given: callers bound R by chunking. A fused
kernel with the same signature and outputs is :func:`liger_dspine.ops.frozen_head_objective.liger_frozen_head_terms`;
the DSpine objective's fused path uses :func:`liger_dspine.ops.frozen_head_loss.liger_frozen_head_loss`.
"""

import torch
import torch.nn.functional as F

from liger_dspine.ops.frozen_head_results import FrozenHeadTerms

__all__ = ["FrozenHeadTerms", "frozen_head_terms", "project_rows"]


def project_rows(rows: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
    """[R, H] x [V, H] -> [R, V] fp32 logits in one 2-D matmul."""
    return F.linear(rows, head_weight).float()


def _teacher_probabilities(teacher_hidden: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.softmax(project_rows(teacher_hidden, head_weight), dim=-1)


def _l1_distance(log_probs: torch.Tensor, teacher_probs: torch.Tensor) -> torch.Tensor:
    return (log_probs.exp() - teacher_probs).abs().sum(dim=-1)


def _top_k_candidates(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    return torch.topk(logits.detach(), top_k, dim=-1).indices


def frozen_head_terms(
    draft_hidden: torch.Tensor,
    head_weight: torch.Tensor,
    labels: torch.Tensor,
    teacher_hidden: torch.Tensor | None = None,
    top_k: int = 0,
) -> FrozenHeadTerms:
    """Per-row CE, L1 to the teacher, top-k candidates and teacher candidate probabilities.

    Args:
        draft_hidden: [R, H] final-normed draft states (any float dtype).
        head_weight: [V, H] the frozen target lm_head weight.
        labels: [R] long, the target token of each row.
        teacher_hidden: [R, H] target final states predicting the same tokens, or None for the CE-only path
            (no teacher projection, no L1, no top-k).
        top_k: K >= 1 when ``teacher_hidden`` is given.

    Returns:
        :class:`FrozenHeadTerms`.
    """
    logits = project_rows(draft_hidden, head_weight)  # [R, V]
    log_probs = torch.log_softmax(logits, dim=-1)
    ce = -log_probs.gather(-1, labels[:, None]).squeeze(-1)
    correct = logits.detach().argmax(dim=-1) == labels
    if teacher_hidden is None:
        return FrozenHeadTerms(ce=ce, correct=correct)
    if top_k < 1:
        raise ValueError(f"frozen_head_terms needs top_k >= 1 with a teacher, got {top_k}")
    teacher_probs = _teacher_probabilities(teacher_hidden, head_weight)
    l1 = _l1_distance(log_probs, teacher_probs)
    candidate_ids = _top_k_candidates(logits, top_k)
    candidate_teacher_probs = teacher_probs.gather(-1, candidate_ids)
    return FrozenHeadTerms(ce, correct, l1, candidate_ids, candidate_teacher_probs)
