"""Key-value heads kept grouped for an attention's backward, whatever kernel runs it.

A grouped-query attention repeats its key and value heads to the query heads before sdpa or the eager product, and
the kernel keeps those repeats (or views of them) for its backward: ``groups`` times the key and value. Inside
:func:`saved_as_grouped`, autograd saving a tensor that shares storage with one of the repeats keeps the grouped
heads instead, with the view's size, stride and offset; the backward repeats them again and takes the same view.
The repeats then live only in the attention's own forward and in its backward. The gradients are unchanged: the
backward reads the same values.

Not installed under torch.compile, without autograd, or inside another saved-tensor hook (activation checkpointing
installs one, and then nothing is kept past the layer anyway).
"""

import contextlib

import torch


class _GroupedHeads:
    """A saved view of ``grouped.repeat_interleave(groups, dim=1)``."""

    __slots__ = ("grouped", "groups", "size", "stride", "offset")

    def __init__(self, grouped: torch.Tensor, groups: int, view: torch.Tensor):
        self.grouped, self.groups = grouped, groups
        self.size, self.stride, self.offset = view.size(), view.stride(), view.storage_offset()

    def unpack(self) -> torch.Tensor:
        repeated = self.grouped.repeat_interleave(self.groups, dim=1)
        return repeated.as_strided(self.size, self.stride, self.offset)


def _storage_key(tensor: torch.Tensor):
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensors without a storage of their own
        return None
    return storage.data_ptr(), storage.nbytes(), tensor.dtype, tensor.device


def _outer_hooks_active() -> bool:
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(True) is not None


def keeps_grouped(groups: int) -> bool:
    """Whether :func:`saved_as_grouped` would change what is saved here and now."""
    return groups > 1 and torch.is_grad_enabled() and not torch.compiler.is_compiling() and not _outer_hooks_active()


@contextlib.contextmanager
def saved_as_grouped(pairs, groups: int):
    """``pairs``: (repeated, grouped) with ``repeated = grouped.repeat_interleave(groups, dim=1)`` (a new tensor).
    Inside, what autograd saves of a repeated tensor is kept as its grouped heads."""
    if not keeps_grouped(groups):
        yield
        return
    table = {}
    for repeated, grouped in pairs:
        if repeated.shape[1] != grouped.shape[1] * groups or not repeated.is_contiguous():
            raise ValueError(
                f"liger-dspine: saved_as_grouped needs contiguous repeats of the grouped heads, got "
                f"{tuple(repeated.shape)} from {tuple(grouped.shape)} and {groups} groups"
            )
        table[_storage_key(repeated)] = grouped.detach()

    def pack(tensor: torch.Tensor):
        grouped = table.get(_storage_key(tensor))
        return tensor if grouped is None else _GroupedHeads(grouped, groups, tensor)

    def unpack(saved):
        return saved.unpack() if isinstance(saved, _GroupedHeads) else saved

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
