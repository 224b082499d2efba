"""CUDA-event timings shared by the benchmark and profile scripts."""

import statistics


def event_times_ms(fn, torch, reps: int, warmup: int = 0) -> list[float]:
    """``reps`` timings of ``fn()`` in ms, each between two CUDA events and synchronised, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def median_ms(fn, torch, reps: int = 20, warmup: int = 3) -> float:
    """The median of ``reps`` timings of ``fn()`` after ``warmup`` calls."""
    return statistics.median(event_times_ms(fn, torch, reps, warmup=warmup))


def median_ms_and_peak_gib(fn, torch, reps: int = 10, warmup: int = 3) -> tuple[float, float]:
    """The median of ``reps`` timings of ``fn()`` after ``warmup`` calls, and the peak memory of the timed calls
    above what was allocated before them, in GiB."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = event_times_ms(fn, torch, reps)
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / 2**30
