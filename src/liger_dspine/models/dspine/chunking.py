"""Chunked, checkpointed reduction of per-block objective terms."""

from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint


def checkpointed_chunk_reduce(
    fn: Callable[..., tuple[torch.Tensor, ...]], tensors: tuple[torch.Tensor, ...], chunk_size: int
) -> tuple[torch.Tensor, ...]:
    """Sum ``fn`` over dim-0 chunks of ``tensors``.

    ``chunk_size == 0`` makes one call over everything. Otherwise each chunk runs under non-reentrant
    activation checkpointing when autograd is on and an input needs grad, so its large intermediates
    (the [chunk, P, V] logits) are recomputed in backward instead of being kept.

    Args:
        fn: maps chunk tensors to a tuple of tensors (summed across chunks).
        tensors: all with the same dim-0 length M.
        chunk_size: blocks per chunk, >= 0.
    """
    if chunk_size < 0:
        raise ValueError(f"objective chunk size must be >= 0, got {chunk_size}")
    length = tensors[0].shape[0]
    if any(t.shape[0] != length for t in tensors):
        raise ValueError(f"chunked tensors disagree on dim 0: {[tuple(t.shape) for t in tensors]}")
    if chunk_size == 0 or length <= chunk_size and not torch.is_grad_enabled():
        return tuple(fn(*tensors))
    use_checkpoint = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    totals = None
    # split, not slices: the backward of a split joins the chunks' gradients once, where each slice's backward
    # would write a zero-filled gradient of the whole tensor and add it to the others
    for chunk in zip(*(t.split(chunk_size) for t in tensors)):
        terms = checkpoint(fn, *chunk, use_reentrant=False) if use_checkpoint else fn(*chunk)
        totals = tuple(terms) if totals is None else tuple(a + b for a, b in zip(totals, terms))
    return totals
