"""Training blocks: anchor sampling, block labels, supervision weights and the draft input ids."""

from typing import NamedTuple

import torch


def _valid_anchors(loss_mask: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """[B, S-1] bool: a and a+1 supervised (and, with ``document_ids``, in the same document)."""
    supervised = loss_mask > 0.5
    valid = supervised[:, :-1] & supervised[:, 1:]
    if document_ids is not None:
        valid = valid & (document_ids[:, :-1] == document_ids[:, 1:])
    return valid


def max_valid_anchor_count(loss_mask: torch.Tensor, document_ids: torch.Tensor | None = None) -> int:
    """Largest number of valid anchors in a row of ``loss_mask`` [B, S] (compute it on a host copy)."""
    return int(_valid_anchors(loss_mask, document_ids).sum(dim=1).max()) if loss_mask.shape[0] > 0 else 0


def sample_anchor_positions(
    loss_mask: torch.Tensor,
    num_anchors: int,
    max_valid_anchors: int | None = None,
    document_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw up to N anchors per row among positions a with loss_mask[a] and loss_mask[a+1] supervised (and, with
    ``document_ids`` [B, S] of a packed row, a+1 in a's document).

    Uses one ``torch.rand([B, S-1])`` on the mask's device. N = min(num_anchors, max_valid_anchors); without
    ``max_valid_anchors`` the largest per-row count is used (a device sync).

    Args:
        loss_mask: [B, S].

    Returns:
        anchors: [B, N] long, kept anchors ascending then zeros.
        keep: [B, N] bool.
    """
    batch, seq = loss_mask.shape
    valid = _valid_anchors(loss_mask, document_ids)  # [B, S-1]
    counts = valid.sum(dim=1)
    if max_valid_anchors is None:
        max_valid_anchors = int(counts.max()) if batch > 0 else 0
    num = min(num_anchors, max_valid_anchors)
    if num <= 0:
        raise ValueError("DSpine needs at least one anchor: no row has two consecutive supervised tokens")
    scores = torch.rand(batch, seq - 1, device=loss_mask.device)
    scores = scores.masked_fill(~valid, 2.0)
    chosen = scores.argsort(dim=1)[:, :num]  # [B, N]
    rank = torch.arange(num, device=loss_mask.device)
    sentinel = seq - 1
    kept = rank[None, :] < counts.clamp(max=num)[:, None]
    anchors = torch.where(kept, chosen, torch.full_like(chosen, sentinel)).sort(dim=1).values
    keep = anchors < sentinel
    return anchors.masked_fill(~keep, 0), keep


class BlockTargets(NamedTuple):
    """labels [B, N, b] long; source [B, N, b] long, clamped position of each label;
    supervised [B, N, P] bool; weights [B, N, P] float (position-decayed, 0 where unsupervised)."""

    labels: torch.Tensor
    source: torch.Tensor
    supervised: torch.Tensor
    weights: torch.Tensor


def block_targets(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    keep: torch.Tensor,
    block_size: int,
    decay_gamma: float | None,
    document_ids: torch.Tensor | None = None,
) -> BlockTargets:
    """Labels of every block slot and the weights of its proposals.

    A proposal counts only if it and every earlier proposal of its block are supervised, and (with
    ``document_ids`` [B, S]) in the anchor's document: a document ends a block as the row's end does. Proposal k
    (1-based) weighs exp(-(k-1)/gamma) when gamma > 0.
    """
    seq = input_ids.shape[1]
    offsets = torch.arange(block_size, device=anchors.device)
    positions = anchors[:, :, None] + offsets  # [B, N, b]
    source = positions.clamp(max=seq - 1)
    flat = source.flatten(1)
    labels = input_ids.gather(1, flat).view_as(source)
    slot_mask = loss_mask.gather(1, flat).view_as(source) > 0.5
    slot_ok = (positions < seq) & keep[:, :, None] & slot_mask
    if document_ids is not None:
        slot_ok = slot_ok & (document_ids.gather(1, flat).view_as(source) == document_ids.gather(1, anchors)[..., None])
    supervised = slot_ok[..., 1:].long().cumprod(dim=-1).bool()
    weights = supervised.float()
    if decay_gamma is not None and decay_gamma > 0:
        decay = torch.exp(-torch.arange(block_size - 1, device=anchors.device, dtype=torch.float32) / decay_gamma)
        weights = weights * decay
    return BlockTargets(labels, source, supervised, weights)


def noise_token_ids(
    input_ids: torch.Tensor, anchors: torch.Tensor, keep: torch.Tensor, block_size: int, mask_token_id: int
) -> torch.Tensor:
    """[B, N*b] draft input ids: the anchor token at each kept block start, ``mask_token_id`` elsewhere."""
    batch, num_blocks = anchors.shape
    anchor_tokens = input_ids.gather(1, anchors)
    anchor_tokens = torch.where(keep, anchor_tokens, torch.full_like(anchor_tokens, mask_token_id))
    ids = torch.full((batch, num_blocks, block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    ids[:, :, 0] = anchor_tokens
    return ids.view(batch, num_blocks * block_size)


def teacher_positions(source: torch.Tensor) -> torch.Tensor:
    """[B, N, P] positions of the target states that predict each proposal label (label position - 1)."""
    return (source[..., 1:] - 1).clamp(min=0)
