"""Training rows for a DSpine drafter: loss masks from assistant spans, and documents packed into one row.

A packed row carries ``position_ids`` that restart at each document. The target sees them (its attention then
stays inside each document) and the objective gets the matching ``document_ids``, which keep every anchor, its
block's labels and the draft's view of the context inside one document.
"""

from typing import NamedTuple

import torch


def document_ids_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] long: 0 for the row's first document, +1 wherever the position does not follow the previous one + 1
    (transformers' rule for packed rows)."""
    previous = torch.cat([position_ids[:, :1] - 1, position_ids[:, :-1]], dim=1)
    return (position_ids != previous + 1).long().cumsum(dim=1)


def assistant_loss_mask(num_tokens: int, spans) -> torch.Tensor:
    """[num_tokens] float: 1 inside the half-open token spans ``[(start, end), ...]`` (the assistant turns)."""
    mask = torch.zeros(num_tokens)
    for start, end in spans:
        if not 0 <= start <= end <= num_tokens:
            raise ValueError(f"liger-dspine: assistant span ({start}, {end}) is outside [0, {num_tokens}]")
        mask[start:end] = 1.0
    return mask


def chat_loss_mask(tokenizer, messages: list[dict], **template_kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [S] and loss mask [S] of a conversation, supervising the assistant turns.

    Uses ``apply_chat_template(..., return_assistant_tokens_mask=True)``, which needs a chat template that marks
    the assistant turns with ``{% generation %}``.
    """
    encoded = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, **template_kwargs
    )
    mask = torch.tensor(encoded["assistant_masks"], dtype=torch.float32)
    if mask.numel() and not bool(mask.any()):
        raise ValueError(
            "liger-dspine: the chat template marked no assistant token; it needs {% generation %} around the "
            "assistant turns (or pass the spans to assistant_loss_mask)"
        )
    return torch.tensor(encoded["input_ids"], dtype=torch.long), mask


class PackedRow(NamedTuple):
    """input_ids, position_ids and loss_mask, each [1, S]."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor


def pack_documents(documents) -> PackedRow:
    """One row from ``[(token ids [S_i], loss mask [S_i]), ...]``: positions restart at 0 for each document."""
    if not documents:
        raise ValueError("liger-dspine: pack_documents needs at least one document")
    ids, positions, masks = [], [], []
    for token_ids, loss_mask in documents:
        token_ids = torch.as_tensor(token_ids, dtype=torch.long)
        loss_mask = torch.as_tensor(loss_mask, dtype=torch.float32)
        if token_ids.dim() != 1 or token_ids.shape != loss_mask.shape or token_ids.numel() == 0:
            raise ValueError(
                "liger-dspine: each packed document needs non-empty 1-D token ids and a loss mask of the same "
                f"shape, got {tuple(token_ids.shape)} and {tuple(loss_mask.shape)}"
            )
        ids.append(token_ids)
        positions.append(torch.arange(token_ids.numel()))
        masks.append(loss_mask)
    return PackedRow(torch.cat(ids)[None], torch.cat(positions)[None], torch.cat(masks)[None])
