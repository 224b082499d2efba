"""Causal-block attention masks and position ids for the draft stream.

Keys index the concatenation [target context (S) ; draft blocks (N*b)]. Query q of block n = q // b, offset
j = q % b sees (when block n is kept) context keys strictly before the block's anchor and the draft keys of its own
block at offsets <= j. Dropped blocks see nothing.

Sliding-window layers (window W) see W positions at most, the query's own included: draft slot j of a block anchored
at a sits at position a + j, so context keys need k >= a + j - (W - 1), and (``window_in_block``) draft keys at
offset o need j - o < W. SpecForge's drafters with ``is_causal`` unset skip the second bound (no window inside the
block): :func:`draft_attention_masks` follows the config.
"""

import torch


def draft_position_ids(anchors: torch.Tensor, context_length: int, block_size: int) -> torch.Tensor:
    """[B, S + N*b] long: 0..S-1 for the context, then ``anchor + j`` for draft slot j of each block."""
    batch = anchors.shape[0]
    offsets = torch.arange(block_size, device=anchors.device)
    context = torch.arange(context_length, device=anchors.device).expand(batch, context_length)
    draft = (anchors[:, :, None] + offsets).reshape(batch, -1)
    return torch.cat([context, draft], dim=1)


SLIDING_ATTENTION = "sliding_attention"


def draft_attention_masks(
    config,
    anchors: torch.Tensor,
    keep: torch.Tensor,
    context_length: int,
    document_ids: torch.Tensor | None = None,
) -> dict:
    """{layer type: mask} for every layer type of a drafter config: flex ``BlockMask``s under "flex_attention",
    dense bool masks otherwise; "sliding_attention" layers get ``config.sliding_window``."""
    build = causal_block_flex_mask if config._attn_implementation == "flex_attention" else causal_block_mask
    masks = {}
    for kind in sorted(set(config.layer_types)):
        window = config.sliding_window if kind == SLIDING_ATTENTION else None
        masks[kind] = build(
            anchors, keep, context_length, config.block_size, document_ids, window, config.is_causal is not None
        )
    return masks


def _check_window(sliding_window) -> None:
    positive_int = isinstance(sliding_window, int) and not isinstance(sliding_window, bool) and sliding_window >= 1
    if sliding_window is not None and not positive_int:
        raise ValueError(f"DSpine sliding_window must be a positive int or None, got {sliding_window!r}")


def causal_block_mask(
    anchors: torch.Tensor,
    keep: torch.Tensor,
    context_length: int,
    block_size: int,
    document_ids: torch.Tensor | None = None,
    sliding_window: int | None = None,
    window_in_block: bool = True,
) -> torch.Tensor:
    """Dense bool mask [B, 1, N*b, S + N*b], True = attend.

    Args:
        anchors: [B, N] long, anchor position of each block in the context.
        keep: [B, N] bool, whether the block is used.
        document_ids: [B, S] long or None, the document of each context position.
        sliding_window: W of a sliding-window layer, None for full attention.
        window_in_block: whether W also bounds the draft keys of the block (see the module docstring).
    """
    _check_window(sliding_window)
    batch, num_blocks = anchors.shape
    device = anchors.device
    draft_length = num_blocks * block_size
    query = torch.arange(draft_length, device=device)
    query_block, query_offset = query // block_size, query % block_size
    # Context part: [B, N*b, S], visible strictly before the anchor.
    query_anchor = anchors.repeat_interleave(block_size, dim=1)
    context_position = torch.arange(context_length, device=device)
    context_visible = context_position < query_anchor[:, :, None]
    if sliding_window is not None:
        lowest = query_anchor + query_offset - (sliding_window - 1)  # [B, N*b]
        context_visible = context_visible & (context_position >= lowest[:, :, None])
    if document_ids is not None:
        anchor_document = document_ids.gather(1, query_anchor)  # [B, N*b]
        context_visible = context_visible & (document_ids[:, None, :] == anchor_document[:, :, None])
    # Draft part: [N*b, N*b], same block and offset <= own offset.
    same_block = query_block[:, None] == query_block[None, :]
    draft_visible = same_block & (query_offset[None, :] <= query_offset[:, None])
    if sliding_window is not None and window_in_block:
        draft_visible = draft_visible & (query_offset[:, None] - query_offset[None, :] < sliding_window)
    draft_visible = draft_visible.expand(batch, draft_length, draft_length)
    visible = torch.cat([context_visible, draft_visible], dim=-1)
    query_keep = keep.repeat_interleave(block_size, dim=1)
    return (visible & query_keep[:, :, None])[:, None]


def causal_block_flex_mask(
    anchors: torch.Tensor,
    keep: torch.Tensor,
    context_length: int,
    block_size: int,
    document_ids: torch.Tensor | None = None,
    sliding_window: int | None = None,
    window_in_block: bool = True,
):
    """The same predicate as :func:`causal_block_mask`, as a flex-attention ``BlockMask`` (H=None)."""
    from torch.nn.attention.flex_attention import create_block_mask

    _check_window(sliding_window)

    batch, num_blocks = anchors.shape
    draft_length = num_blocks * block_size

    def mask_mod(b, h, q_idx, kv_idx):
        block = q_idx // block_size
        offset = q_idx % block_size
        anchor = anchors[b, block]
        in_context = (kv_idx < context_length) & (kv_idx < anchor)
        if sliding_window is not None:
            in_context = in_context & (kv_idx >= anchor + offset - (sliding_window - 1))
        if document_ids is not None:
            context_key = kv_idx.clamp(max=context_length - 1)
            in_context = in_context & (document_ids[b, context_key] == document_ids[b, anchor])
        draft_idx = kv_idx - context_length
        draft_offset = draft_idx % block_size
        in_block = (kv_idx >= context_length) & (draft_idx // block_size == block) & (draft_offset <= offset)
        if sliding_window is not None and window_in_block:
            in_block = in_block & (offset - draft_offset < sliding_window)
        return keep[b, block] & (in_context | in_block)

    return create_block_mask(mask_mod, batch, None, draft_length, context_length + draft_length, device=anchors.device)
