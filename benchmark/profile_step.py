"""Where the time and the memory of one DeepSeek-V3 (or DeepSeek-family) training step go (GPU).

Time: torch.profiler over one step after two warm-ups; CUDA kernels grouped into GEMM / attention / Triton /
elementwise+copy, and the top kernels; the host side (wall time, CUDA runtime calls, operators, Python functions
by cProfile, synchronisations). Memory: a census of the tensors autograd saves for backward, by shape.

    python benchmark/profile_step.py --impl liger-dspine --layers 8 --seq 4096 [--options JSON]
    python benchmark/profile_step.py --model deepseek_v2 --impl hf --layers 2 --seq 4096   # bench_family.py's widths
    python benchmark/profile_step.py --layers 2 --compile --peak-blocks   # torch.compile'd; what is live at the peak

With ``--compile`` the step runs ``torch.compile(model)`` (inductor): the census of saved tensors is left out (the
compiled graph saves its own), and ``--peak-blocks`` lists the allocations live at the step's memory peak with the
code that made them (inductor's generated code included).
"""

import argparse
import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_deepseek_v3 import _apply_patch  # noqa: E402
from bench_deepseek_v3 import deepseek_v3_config  # noqa: E402


def kernel_category(name: str) -> str:
    lowered = name.lower()
    if any(k in lowered for k in ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas", "matmul")):
        return "gemm"
    if any(k in lowered for k in ("flash", "fmha", "cudnn", "attention", "sdpa")):
        return "attention"
    if "triton" in lowered or lowered.startswith("_"):
        return "triton"
    return "elementwise+copy"


def saved_tensor_census(torch):
    """(pack hook for ``saved_tensors_hooks``, Counter {(shape, dtype): bytes}): each CUDA storage autograd saves,
    counted once (parameters left out)."""
    saved = collections.Counter()
    seen = set()

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.dtype)
        if t.is_cuda and key not in seen and not isinstance(t, torch.nn.Parameter):
            seen.add(key)
            saved[(tuple(t.shape), str(t.dtype).replace("torch.", ""))] += t.untyped_storage().nbytes()
        return t

    return pack, saved


def print_saved(saved, top: int, title: str) -> None:
    print(f"\n## saved for backward ({title}): {sum(saved.values()) / 2**30:.2f} GiB, unique storages")
    for (shape, dtype), nbytes in saved.most_common(top):
        print(f"{nbytes / 2**20:10.1f} MiB  {dtype:9s} {shape}")


def print_kernels(torch, prof, top: int, title: str) -> None:
    """CUDA time of a profiled region by kernel category, and the top kernels."""
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_cat = collections.Counter()
    for e in events:
        by_cat[kernel_category(e.key)] += e.self_device_time_total
    total_us = sum(by_cat.values())
    print(f"\n## CUDA time of {title}: {total_us / 1000:.1f} ms")
    for cat, us in by_cat.most_common():
        print(f"{cat:18s} {us / 1000:8.1f} ms  {100 * us / total_us:5.1f}%")
    print("\n## top kernels")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:top]:
        print(f"{e.self_device_time_total / 1000:8.2f} ms  x{e.count:<4d} [{kernel_category(e.key)}] {e.key[:110]}")


def print_operators(torch, prof, top: int) -> None:
    """The operators (with their input shapes) that launched the kernels: which elementwise kernel is which. The
    profile must have been recorded with ``record_shapes=True``."""
    operators = [
        e
        for e in prof.key_averages(group_by_input_shape=True)
        if e.device_type == torch.autograd.DeviceType.CPU and e.self_device_time_total > 0
    ]
    print("\n## top operators by the device time of the kernels they launch (input shapes)")
    for e in sorted(operators, key=lambda e: -e.self_device_time_total)[: 2 * top]:
        shapes = str(e.input_shapes)[:90]
        print(f"{e.self_device_time_total / 1000:8.2f} ms  x{e.count:<4d} {e.key[:40]:40s} {shapes}")


def print_syncs(torch, step) -> None:
    """Each call in one step that makes the host wait for the GPU (``torch.cuda.set_sync_debug_mode``), with the
    innermost frames of the package, transformers and liger-kernel that led to it."""
    import traceback
    import warnings

    found = []

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [
            f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}"
            for f in traceback.extract_stack()[:-1]
            if any(k in f.filename for k in ("liger_dspine", "liger_kernel", "transformers", "benchmark"))
        ]
        found.append((str(message).split("\n")[0][:70], frames[-3:]))

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    print(f"\n## host synchronisations in one step: {len(found)}")
    for message, frames in found:
        print(f"  {message}\n      " + "\n      ".join(frames))


def print_host(torch, prof, step, top: int, title: str) -> None:
    """The host side of a step: its wall time against the CUDA time above (a step whose wall time exceeds its CUDA
    time waits on the CPU), the CUDA runtime calls (launches, and the copies / synchronisations that block the host,
    with the time spent in them) and the operators with the most CPU time of their own."""
    import time

    walls = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - start)
    print(f"\n## host ({title}): wall time of a step {1000 * sorted(walls)[2]:.1f} ms (median of 5)")
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU]
    runtime = [e for e in events if e.key.startswith(("cuda", "cu"))]
    print("CUDA runtime calls in the profiled step (count, host time inside them):")
    for e in sorted(runtime, key=lambda e: -e.self_cpu_time_total)[:12]:
        print(f"{e.self_cpu_time_total / 1000:8.2f} ms  x{e.count:<5d} {e.key[:60]}")
    print("operators by their own CPU time (profiler overhead included):")
    for e in sorted((e for e in events if e not in runtime), key=lambda e: -e.self_cpu_time_total)[:top]:
        print(f"{e.self_cpu_time_total / 1000:8.2f} ms  x{e.count:<5d} {e.key[:70]}")


# a sleep kernel queued before a step keeps the GPU busy for longer than the host takes to queue the step
_HOLD_GPU_CYCLES = 10**9


def print_host_only(torch, forward, backward, title: str) -> None:
    """The host's own time for one step: the GPU is held busy by a sleep kernel queued first, so the host never
    waits for it, except at a synchronisation (then the figure includes the sleep: see the count below). Waits on
    CUDA events (the label check's) are timed and left out."""
    import time

    waited = [0.0]
    event_synchronize = torch.cuda.Event.synchronize

    def timed_synchronize(event):
        start = time.perf_counter()
        event_synchronize(event)
        waited[0] += time.perf_counter() - start

    rows = []
    torch.cuda.Event.synchronize = timed_synchronize
    try:
        for _ in range(5):
            torch.cuda.synchronize()
            torch.cuda._sleep(_HOLD_GPU_CYCLES)
            waited[0] = 0.0
            start = time.perf_counter()
            loss = forward()
            mid = time.perf_counter()
            forward_wait = waited[0]
            backward(loss)
            rows.append((mid - start - forward_wait, time.perf_counter() - mid - (waited[0] - forward_wait)))
            torch.cuda.synchronize()
    finally:
        torch.cuda.Event.synchronize = event_synchronize
    fwd, bwd = sorted(rows, key=sum)[len(rows) // 2]
    print(
        f"\n## host time of one step, the GPU held busy ({title}): forward {fwd * 1e3:.1f} ms, "
        f"backward {bwd * 1e3:.1f} ms, total {(fwd + bwd) * 1e3:.1f} ms (median of 5)"
    )


def print_python(torch, step, top: int) -> None:
    """The Python functions of one step by their own time (cProfile), the GPU held busy as in
    :func:`print_host_only`: where a host-bound step spends its host time beyond the operators above (module code,
    autograd Functions, Triton's launchers)."""
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    torch.cuda.synchronize()
    torch.cuda._sleep(_HOLD_GPU_CYCLES)
    profile.enable()
    step()
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(top)
    print(f"\n## Python functions of one step by their own time (cProfile, top {top})")
    print(text.getvalue().strip())


def _frame_label(frame) -> str:
    import linecache

    source = linecache.getline(frame["filename"], frame["line"]).strip()
    return f"{frame['filename'].rsplit('/', 1)[-1]}:{frame['line']} {frame['name']}: {source[:80]}"


def print_peak_blocks(torch, step, top: int) -> None:
    """The allocations of one step live at its memory peak (above what was allocated before the step), largest
    first, each with the innermost frames of the package, transformers or inductor's generated code."""
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=500000)
    step()
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    live, current, peak, at_peak = {}, 0, 0, {}
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            current += event["size"]
            if current > peak:
                peak, at_peak = current, dict(live)
        elif event["action"] == "free_completed" and event["addr"] in live:
            current -= live.pop(event["addr"])["size"]
    keep = ("liger_dspine", "transformers", "torchinductor", "_functorch", "benchmark")
    print(f"\n## allocations live at the step's peak: {peak / 2**30:.2f} GiB above the step's start")
    for event in sorted(at_peak.values(), key=lambda e: -e["size"])[:top]:
        frames = [f for f in event.get("frames", []) if any(k in f["filename"] for k in keep)]
        print(f"{event['size'] / 2**20:10.1f} MiB  " + "\n                ".join(_frame_label(f) for f in frames[:3]))


def _memory_trace(torch, model, ids) -> None:
    """Allocated memory and the peak so far when each decoder layer and its attention / MLP block starts and ends,
    in forward and in backward: where the step's peak happens."""
    gib = 2**30
    events = []

    def note(what):
        events.append((what, torch.cuda.memory_allocated() / gib, torch.cuda.max_memory_allocated() / gib))

    handles = []
    for name, module in model.named_modules():
        last = name.split(".")[-1]
        if not (last in ("self_attn", "mlp", "lm_head") or last.isdigit()):  # layers, their attention and MLP
            continue
        handles.append(module.register_forward_pre_hook(lambda m, a, name=name: note(f"fwd start {name}")))
        handles.append(module.register_forward_hook(lambda m, a, o, name=name: note(f"fwd end   {name}")))
        handles.append(module.register_full_backward_pre_hook(lambda m, g, name=name: note(f"bwd start {name}")))
        handles.append(module.register_full_backward_hook(lambda m, gi, go, name=name: note(f"bwd end   {name}")))
    torch.cuda.reset_peak_memory_stats()
    loss = model(input_ids=ids, labels=ids).loss
    note("after forward")
    loss.backward()
    torch.cuda.synchronize()
    note("after backward")
    for handle in handles:
        handle.remove()
    for p in model.parameters():
        p.grad = None
    print("\n## memory trace (GiB: allocated, peak so far)")
    for what, allocated, peak in events:
        print(f"{allocated:7.2f} {peak:7.2f}  {what}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", default="liger-dspine", help="hf, liger or liger-dspine")
    parser.add_argument("--model", default="deepseek_v3", help="deepseek_v3 or a model of family_configs.FAMILY")
    parser.add_argument("--layers", type=int, help="default 8 for deepseek_v3, the benchmark's depth for the family")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--options", help="liger-dspine options as JSON (default: the family benchmark's)")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--no-time", action="store_true", help="memory only: skip the profiled step")
    parser.add_argument("--memory-trace", action="store_true", help="memory at each layer / block boundary")
    parser.add_argument("--compile", action="store_true", help="profile torch.compile(model) (inductor)")
    parser.add_argument("--peak-blocks", action="store_true", help="the allocations live at the step's peak")
    args = parser.parse_args()

    import torch

    from family_configs import LIGER_DSPINE_OPTIONS
    from family_configs import family_layers

    if args.layers is None:
        args.layers = 8 if args.model == "deepseek_v3" else family_layers(args.model)
    if args.options is not None:
        options = json.loads(args.options)
    else:
        options = LIGER_DSPINE_OPTIONS.get(args.model, {}) if args.impl == "liger-dspine" else {}
    _apply_patch(args.impl, options, args.model)
    if args.model == "deepseek_v3":
        from transformers import DeepseekV3ForCausalLM as model_class

        config = deepseek_v3_config(args.layers, tiny=False, max_seq=args.seq)
    else:
        from family_configs import family_class
        from family_configs import family_config

        config, model_class = family_config(args.model, args.layers, False, args.seq), family_class(args.model)
    with torch.device("cuda"):
        torch.set_default_dtype(torch.bfloat16)
        model = model_class(config)
        torch.set_default_dtype(torch.float32)
    model.train()
    ids = torch.randint(0, config.vocab_size, (1, args.seq), device="cuda")

    run = torch.compile(model) if args.compile else model

    def forward():
        return run(input_ids=ids, labels=ids).loss

    def backward(loss):
        loss.backward()
        for p in model.parameters():
            p.grad = None

    def step():
        backward(forward())

    for _ in range(2):
        step()
    torch.cuda.synchronize()

    pack, saved = saved_tensor_census(torch)

    torch.cuda.reset_peak_memory_stats()
    if args.compile:
        loss = forward()
    else:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = forward()
    torch.cuda.synchronize()
    after_forward, forward_peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss.backward()
    torch.cuda.synchronize()
    backward_peak = torch.cuda.max_memory_allocated()
    gib = 2**30
    print(
        f"\n## memory ({args.impl} {args.layers}L/{args.seq}): forward peak {forward_peak / gib:.2f} GiB, "
        f"after forward {after_forward / gib:.2f} GiB, backward peak {backward_peak / gib:.2f} GiB"
    )
    for p in model.parameters():
        p.grad = None
    if not args.compile:
        print_saved(saved, args.top, f"{args.impl} {args.layers}L/{args.seq}")
    if args.peak_blocks:
        print_peak_blocks(torch, step, args.top)

    if args.memory_trace:
        _memory_trace(torch, model, ids)
    if args.no_time:
        return 0
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        step()
        torch.cuda.synchronize()
    print_kernels(torch, prof, args.top, f"one step ({args.impl} {args.layers}L/{args.seq})")
    print_operators(torch, prof, args.top)
    print_host(torch, prof, step, args.top, f"{args.impl} {args.layers}L/{args.seq}")
    print_host_only(torch, forward, backward, f"{args.impl} {args.layers}L/{args.seq}")
    print_python(torch, step, args.top)
    print_syncs(torch, step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
