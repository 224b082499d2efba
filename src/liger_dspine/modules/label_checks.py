"""The labels of a causal-LM loss, checked before any kernel reads them: a ``TypeError`` for a tensor that is not
of integers, a ``ValueError`` for a target outside ``[0, vocab)`` that is not the ignore index (instead of a
device-side assert or an out-of-bounds read in a kernel).

Only what becomes a target is checked: for ``labels`` (shifted inside the loss) the first position of each row never
is one, so its value does not matter, as in transformers' loss; for ``shift_labels`` every position is.

On a GPU the range of the labels is reduced and copied to the host asynchronously before the decoder runs, and read
after the decoder's kernels are queued, just before the loss: the host then waits only for that small reduction,
queued ahead of the decoder, so the GPU's queue is never drained by the check. Under torch.compile the same two
halves are two opaque ops: the first returns the bounds in host memory (copied without waiting), the second waits
for that copy, checks and returns a copy of the labels, which the loss then reads, so the check stays in the graph
without a graph break and without draining the queue (a single op would have waited for the whole queue at the
start of the step).
"""

import torch

IGNORE_INDEX = -100


def checked_labels(labels: torch.Tensor, vocab_size: int, ignore_index: int = IGNORE_INDEX, shifted: bool = True):
    """``(labels, finish)``: call ``finish(after)`` before any kernel reads the labels and read the labels it
    returns; it raises what :func:`check_label_range` raises. ``after``: a tensor the loss reads, made after the
    decoder's kernels (a compiled graph does not wait for the check before it). ``shifted=False``: ``labels`` is
    shifted by the loss, so its first position of each row is left out of the check. On a CUDA device the check is
    read in ``finish``; elsewhere it runs here."""
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"liger-dspine: labels must be a tensor of token ids, got {type(labels).__name__}")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise TypeError(f"liger-dspine: labels must be a tensor of integer token ids, got {labels.dtype}")
    if torch.compiler.is_compiling():
        if labels.is_cuda:
            bounds = _label_bounds_to_host_op(labels, ignore_index, shifted)

            def finish_in_graph(after: torch.Tensor) -> torch.Tensor:
                return _finish_label_check_op(labels, bounds, after, vocab_size, ignore_index, shifted)

            return labels, finish_in_graph
        checked = _checked_labels_op(labels, vocab_size, ignore_index, shifted)
        return checked, lambda after: checked
    targets = _targets_of(labels, shifted)
    if targets.is_cuda and targets.numel():
        wait_and_check = _start_label_range_check(targets, vocab_size, ignore_index)

        def finish(after: torch.Tensor) -> torch.Tensor:
            wait_and_check()
            return labels

        return labels, finish
    check_label_range(targets, vocab_size, ignore_index)
    return labels, lambda after: labels


def _targets_of(labels: torch.Tensor, shifted: bool) -> torch.Tensor:
    return labels if shifted or labels.dim() == 0 else labels[..., 1:]


def _start_label_range_check(labels: torch.Tensor, vocab_size: int, ignore_index: int):
    """Queue the reduction of the labels' range and its copy to pinned host memory; return the function that waits
    for that copy (not for the work queued after it) and raises as :func:`check_label_range` does."""
    on_host, copied = _copy_bounds_to_host(labels, ignore_index)
    return lambda: _check_copied_bounds(on_host, copied, labels, vocab_size, ignore_index)


def _copy_bounds_to_host(labels: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.cuda.Event]:
    """(bounds, event): CUDA ``labels``' :func:`_label_bounds` ([2] int64, zeros for no labels) being copied to
    pinned host memory without waiting, and the event recorded after the copy."""
    with torch.cuda.device(labels.device):
        on_host = torch.empty(2, dtype=torch.int64, pin_memory=True)
        if labels.numel():
            on_host.copy_(_label_bounds(labels, ignore_index).to(torch.int64), non_blocking=True)
        else:
            on_host.zero_()
        copied = torch.cuda.Event()
        copied.record()
    return on_host, copied


def _check_copied_bounds(on_host, copied, labels, vocab_size: int, ignore_index: int) -> None:
    """Wait for the copy of :func:`_copy_bounds_to_host` and raise as :func:`check_label_range` does."""
    copied.synchronize()
    low, high = on_host.tolist()
    if labels.numel() and not (low >= 0 and high < vocab_size):
        _raise_label_range_error(labels, vocab_size, ignore_index)


_COPIES_IN_FLIGHT: dict[int, torch.cuda.Event] = {}  # host address of the bounds -> the event after their copy


@torch.library.custom_op("liger_dspine::label_bounds_to_host", mutates_args=())
def _label_bounds_to_host_op(labels: torch.Tensor, ignore_index: int, shifted: bool) -> torch.Tensor:
    """[2] int64 in host memory (pinned for a CUDA ``labels``): the smallest and largest target that is not
    ``ignore_index``, copied without waiting; :func:`_finish_label_check_op` waits for the copy."""
    targets = _targets_of(labels, shifted)
    if not targets.is_cuda:
        bounds = _label_bounds(targets, ignore_index) if targets.numel() else torch.zeros(2, dtype=torch.int64)
        return bounds.to(torch.int64).cpu()
    on_host, copied = _copy_bounds_to_host(targets, ignore_index)
    _COPIES_IN_FLIGHT[on_host.data_ptr()] = copied
    return on_host


@_label_bounds_to_host_op.register_fake
def _(labels, ignore_index, shifted):
    return torch.empty(2, dtype=torch.int64, device="cpu")


@torch.library.custom_op("liger_dspine::finish_label_check", mutates_args=())
def _finish_label_check_op(
    labels: torch.Tensor, bounds: torch.Tensor, after: torch.Tensor, vocab_size: int, ignore_index: int, shifted: bool
) -> torch.Tensor:
    """A copy of ``labels`` once the bounds from :func:`_label_bounds_to_host_op` are known to lie in
    ``[0, vocab_size)``; a ValueError otherwise. Bounds whose copy it cannot find waiting are found again here.
    ``after`` is not read: as an input it keeps a compiled graph from waiting before ``after``'s kernels are queued
    (inductor would schedule the op right after the bounds' copy, waiting for the whole queue at once)."""
    copied = _COPIES_IN_FLIGHT.pop(bounds.data_ptr(), None)
    targets = _targets_of(labels, shifted)
    if copied is not None:
        _check_copied_bounds(bounds, copied, targets, vocab_size, ignore_index)
    else:
        check_label_range(targets, vocab_size, ignore_index)
    return labels.clone()


@_finish_label_check_op.register_fake
def _(labels, bounds, after, vocab_size, ignore_index, shifted):
    return torch.empty_like(labels)


@torch.library.custom_op("liger_dspine::checked_labels", mutates_args=())
def _checked_labels_op(labels: torch.Tensor, vocab_size: int, ignore_index: int, shifted: bool) -> torch.Tensor:
    check_label_range(_targets_of(labels, shifted), vocab_size, ignore_index)
    return labels.clone()


@_checked_labels_op.register_fake
def _(labels, vocab_size, ignore_index, shifted):
    return torch.empty_like(labels)


def check_label_range(labels: torch.Tensor, vocab_size: int, ignore_index: int = IGNORE_INDEX) -> None:
    """Raise ValueError if a label is neither in ``[0, vocab_size)`` nor ``ignore_index``."""
    if labels.numel() == 0:
        return
    low, high = _label_bounds(labels, ignore_index).tolist()  # the one host sync
    if not (low >= 0 and high < vocab_size):
        _raise_label_range_error(labels, vocab_size, ignore_index)


def _label_bounds(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """[2]: the smallest and the largest label that is not ``ignore_index`` (0 stands in for ignored ones)."""
    return torch.stack(torch.where(labels != ignore_index, labels, 0).aminmax())


def _raise_label_range_error(labels: torch.Tensor, vocab_size: int, ignore_index: int) -> None:
    kept = labels != ignore_index
    bad = labels[kept & ((labels < 0) | (labels >= vocab_size))]
    raise ValueError(
        f"liger-dspine: labels must be in [0, {vocab_size}) (the vocabulary of lm_head) or {ignore_index} (the ignore "
        f"index); {bad.numel()} label(s) are outside, with values from {bad.min().item()} to {bad.max().item()}"
    )
