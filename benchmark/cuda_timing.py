"""CUDA-event timings shared by the benchmark and profile scripts."""


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
