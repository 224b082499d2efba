"""Compiling backward kernels in background threads while the forward runs (CUDA only).

A cold first training step compiles every Triton kernel it meets, one after the other, and Triton 3.6 also builds a
C launcher per kernel signature with the host compiler: at DeepSeek-V4's widths about 13 s of compilation and 6 s
of launcher builds, half of them for backward kernels that are only needed seconds later. An op's forward can hand
those to :func:`precompile`: the kernel is compiled for the backward's argument types and compile-time values in a
thread (Triton's compiler and the host compiler release the GIL for most of the work) and put into the kernel's own
cache, and its launcher is built into Triton's cache; the backward then finds both. Nothing here changes what runs:
a kernel the background has not finished is compiled by the backward as it would have been, and a background
failure is logged and otherwise ignored. ``LIGER_DSPINE_PRECOMPILE=0`` turns it off.
"""

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_submitted: set = set()
_executor: ThreadPoolExecutor | None = None
_pending: list = []


def enabled() -> bool:
    return os.environ.get("LIGER_DSPINE_PRECOMPILE", "1").strip().lower() not in ("0", "false", "no", "off")


def _specialization(value):
    """What of an argument Triton's cache key depends on, roughly: a tensor's dtype, an int's 1 / 16-divisibility."""
    if isinstance(value, torch.Tensor):
        return str(value.dtype)
    if isinstance(value, bool) or not isinstance(value, int):
        return repr(value) if not isinstance(value, float) else "float"
    return value == 1, value % 16 == 0


def precompile(kernel, *args, **meta) -> None:
    """Compile ``kernel`` for a later launch with these arguments (tensors stand for their dtype and a 16-byte
    aligned address, as fresh allocations are) and launch options, once per specialisation and device."""
    if not enabled() or not torch.cuda.is_available() or not hasattr(kernel, "warmup"):
        return
    device = torch.cuda.current_device()
    key = (id(kernel), device, tuple(_specialization(a) for a in args), tuple(sorted(meta.items())))
    with _lock:
        if key in _submitted:
            return
        _submitted.add(key)
    stand_ins = [a.dtype if isinstance(a, torch.Tensor) else a for a in args]
    future = _pool().submit(_compile, kernel, device, stand_ins, meta)
    with _lock:
        _pending.append(future)


def wait() -> None:
    """Block until every compilation submitted so far has finished."""
    with _lock:
        pending, _pending[:] = list(_pending), []
    for future in pending:
        future.result()


def _pool() -> ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            workers = max(1, min(8, (os.cpu_count() or 2) - 1))
            _executor = ThreadPoolExecutor(workers, thread_name_prefix="liger-dspine-precompile")
        return _executor


def _compile(kernel, device: int, args: list, meta: dict) -> None:
    try:
        with torch.cuda.device(device):
            compiled = kernel.warmup(*args, grid=(1,), **meta)
            if compiled is not None and hasattr(compiled, "src") and hasattr(compiled, "metadata"):
                from triton.runtime import driver

                # the launcher into Triton's cache only: the kernel object itself is set up by its first launch
                driver.active.launcher_cls(compiled.src, compiled.metadata)
    except Exception as error:  # the launch compiles the kernel itself; only time is lost
        logger.debug("liger-dspine: precompiling %s failed: %s", getattr(kernel, "__name__", kernel), error)
