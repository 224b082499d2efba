"""Drafting DSpine blocks at inference, from the target's taps.

A block is [anchor, mask, ..., mask] at positions anchor .. anchor + b - 1; the drafter sees the target's taps strictly
before the anchor. One drafter forward gives every block's proposal states; then either

- ``plain``: the argmax of the drafter's logits ``lm_head(hidden)`` at each proposal slot, or
- ``refined``: the top-K candidates of those logits, the :meth:`~DSpineDraftModel.transition_scores` of every
  candidate under every predecessor choice, and the greedy path through them (:meth:`~DSpineDraftModel.select_cached`).

Both read only the drafter's modules, so a drafter built with ``use_liger_kernel`` or patched by
``apply_liger_kernel_to_dspine`` drafts through the Liger modules.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F

from liger_dspine.models.dspine.masks import draft_attention_masks
from liger_dspine.models.dspine.masks import draft_position_ids


class ProposalStates(NamedTuple):
    """hidden [B, N, P, H] (final-normed) and pre_injection [B, N, P, H] of the proposal slots."""

    hidden: torch.Tensor
    pre_injection: torch.Tensor


class DraftedBlocks(NamedTuple):
    """plain [B, N, P] long (argmax of the drafter's logits); refined [B, N, P] long (greedy path through the
    transition scores), None when not asked for."""

    plain: torch.Tensor
    refined: torch.Tensor | None


def block_input_ids(anchor_ids: torch.Tensor, block_size: int, mask_token_id: int) -> torch.Tensor:
    """[B, N, b] long: each block's anchor id, then ``mask_token_id``."""
    ids = anchor_ids.new_full((*anchor_ids.shape, block_size), mask_token_id)
    ids[..., 0] = anchor_ids
    return ids


@torch.no_grad()
def proposal_states(
    draft,
    embed_tokens: torch.nn.Module,
    taps: torch.Tensor,
    anchor_positions: torch.Tensor,
    anchor_ids: torch.Tensor,
    keep: torch.Tensor | None = None,
) -> ProposalStates:
    """One drafter forward over N blocks per row.

    Args:
        draft: a :class:`DSpineDraftModel`.
        embed_tokens: the target's input embedding.
        taps: [B, S, T*H] the target's taps at positions 0 .. S-1.
        anchor_positions: [B, N] long, each block's anchor position (<= S; the block sees taps before it).
        anchor_ids: [B, N] long, each block's anchor token.
        keep: [B, N] bool, the blocks to draft (default all).
    """
    batch, num_blocks = anchor_positions.shape
    block_size = draft.block_size
    if keep is None:
        keep = torch.ones_like(anchor_positions, dtype=torch.bool)
    ids = block_input_ids(anchor_ids, block_size, draft.mask_token_id)  # [B, N, b]
    dtype = draft.fc.weight.dtype
    noise = embed_tokens(ids.view(batch, num_blocks * block_size)).to(dtype)
    context = taps.shape[1]
    kwargs = {}
    if (draft.config._attn_implementation or "sdpa") == "flex_attention":
        kwargs["kernel_options"] = {"BACKEND": "TRITON"}
    out = draft(
        draft_position_ids(anchor_positions, context, block_size),
        draft_attention_masks(draft.config, anchor_positions, keep, context),
        noise,
        taps.to(dtype),
        ids,
        None,
        **kwargs,
    )
    return ProposalStates(out.hidden_states[:, :, 1:], out.pre_injection[:, :, 1:])


def drafter_logits(states: ProposalStates, head_weight: torch.Tensor) -> torch.Tensor:
    """[B, N, P, V] fp32 logits of the proposal slots through the frozen head."""
    return F.linear(states.hidden.to(head_weight.dtype), head_weight).float()


@torch.no_grad()
def refined_candidates(
    draft, states: ProposalStates, logits: torch.Tensor, anchor_ids: torch.Tensor, head_weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-K candidates [B, N, P, K] of ``logits`` and their transition scores [B, N, P, K, K] fp32."""
    candidates = logits.topk(draft.dspine_config.top_k, dim=-1).indices
    scores = draft.transition_scores(states.pre_injection, candidates, anchor_ids, head_weight)
    return candidates, scores


@torch.no_grad()
def draft_blocks(
    draft,
    embed_tokens: torch.nn.Module,
    head_weight: torch.Tensor,
    taps: torch.Tensor,
    anchor_positions: torch.Tensor,
    anchor_ids: torch.Tensor,
    keep: torch.Tensor | None = None,
    refine: bool = True,
) -> DraftedBlocks:
    """Greedy drafts of N blocks per row: the plain argmax and (``refine``) the refined path.

    Args:
        draft: a :class:`DSpineDraftModel` with its transfer space.
        embed_tokens: the target's input embedding; head_weight: the target's lm_head weight [V, H].
        taps: [B, S, T*H]; anchor_positions / anchor_ids: [B, N] long; keep: [B, N] bool or None.

    Returns:
        :class:`DraftedBlocks` with [B, N, P] proposals.
    """
    states = proposal_states(draft, embed_tokens, taps, anchor_positions, anchor_ids, keep)
    logits = drafter_logits(states, head_weight)
    plain = logits.argmax(dim=-1)
    if not refine:
        return DraftedBlocks(plain, None)
    candidates, scores = refined_candidates(draft, states, logits, anchor_ids, head_weight)
    return DraftedBlocks(plain, draft.select_cached(scores, candidates))
