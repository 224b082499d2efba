"""The per-row results of the frozen-head terms, shared by the eager function and the fused ops (no Triton)."""

from typing import NamedTuple

import torch


class FrozenHeadTerms(NamedTuple):
    """Per-row results; all [R] or [R, K]. The last three are None on the CE-only path.

    ce: fp32, -log softmax(x W^T)[label].
    correct: bool, argmax of the draft logits == label (no grad).
    l1: fp32, sum_v |softmax(x W^T)_v - softmax(t W^T)_v|.
    candidate_ids: long [R, K], top-k draft logits, descending (no grad).
    candidate_teacher_probs: fp32 [R, K], teacher probabilities at candidate_ids (no grad).
    """

    ce: torch.Tensor
    correct: torch.Tensor
    l1: torch.Tensor | None = None
    candidate_ids: torch.Tensor | None = None
    candidate_teacher_probs: torch.Tensor | None = None


class FrozenHeadLoss(NamedTuple):
    """The weighted loss of :func:`liger_frozen_head_loss` and its per-row terms.

    loss: fp32 scalar, sum_r ce_scale_r * ce_r + l1_scale_r * l1_r, differentiable in the draft rows.
    terms: :class:`FrozenHeadTerms`, every tensor detached.
    """

    loss: torch.Tensor
    terms: FrozenHeadTerms
