"""Where the time and the memory of DSpine training go (GPU).

- ``--part objective``: the fused objective with the Liger drafter modules (``DSpineObjective.block_terms`` forward
  + backward, bench_dspine's liger-dspine row) at one width under torch.profiler; CUDA kernels grouped into GEMM /
  Triton / other, and the top kernels.
- ``--part step``: one whole training step (accumulation 1, Liger layers and fused objective unless ``--native``):
  allocated memory and the peak so far at the start and end of each drafter layer's forward, of the objective,
  after the backward and after the optimizer step; the tensors saved for backward by shape.

    python benchmark/profile_dspine.py --part objective --hidden 7168 --vocab 129280
    python benchmark/profile_dspine.py --part step [--head-chunk-rows 512]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_dspine import build_objective  # noqa: E402
from bench_dspine import objective_inputs  # noqa: E402
from bench_dspine import step_batch  # noqa: E402
from cuda_timing import event_times_ms  # noqa: E402
from profile_step import print_kernels  # noqa: E402
from profile_step import print_operators  # noqa: E402
from profile_step import print_saved  # noqa: E402
from profile_step import saved_tensor_census  # noqa: E402

GIB = 2**30


def profile_objective(torch, args) -> None:
    objective = build_objective(args.hidden, args.vocab, 1, True, True, torch.bfloat16, "cuda", False)
    objective.head_chunk_rows = args.head_chunk_rows
    inputs = objective_inputs(objective, args.blocks, 11, "cuda", torch.bfloat16)
    leaves = [inputs[k] for k in ("hidden", "pre", "features")]

    def call():
        for leaf in leaves:
            leaf.grad = None
        backbone, _, _, ref, align, _, _ = objective.block_terms(**inputs)
        (backbone + ref + 0.5 * align).backward()

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        call()
        torch.cuda.synchronize()
    title = f"objective {args.hidden} / {args.vocab}, {args.blocks} blocks, head chunk rows {args.head_chunk_rows}"
    print_kernels(torch, prof, args.top, title)
    print_operators(torch, prof, args.top)
    times = event_times_ms(call, torch, 5)
    print(f"\n## {title}: {sorted(times)[2]:.1f} ms a call (median of 5, CUDA events)")


def profile_step(torch, args) -> None:
    liger = fused = not args.native
    objective = build_objective(4096, 151936, 5, liger, fused, torch.bfloat16, "cuda", False, anchors=512)
    objective.head_chunk_rows = args.head_chunk_rows
    draft = objective.draft_model
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-5)
    batch = step_batch(objective, 2, 3072, 100, "cuda", torch.bfloat16)

    def step():
        torch.manual_seed(1000)
        objective(**batch, global_step=100, total_steps=1000).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    events = []

    def note(what):
        events.append((what, torch.cuda.memory_allocated() / GIB, torch.cuda.max_memory_allocated() / GIB))

    handles = []
    watched = [(f"layer {i}", layer) for i, layer in enumerate(draft.layers)] + [("objective", objective)]
    for name, module in watched:
        handles.append(module.register_forward_pre_hook(lambda m, a, name=name: note(f"fwd start {name}")))
        handles.append(module.register_forward_hook(lambda m, a, o, name=name: note(f"fwd end   {name}")))
    pack, saved = saved_tensor_census(torch)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated() / GIB
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(1000)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = objective(**batch, global_step=100, total_steps=1000)
    note("after forward")
    out.loss.backward()
    torch.cuda.synchronize()
    note("after backward")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    note("after optimizer step")
    for handle in handles:
        handle.remove()
    kind = "native" if args.native else "liger-dspine"
    print(f"\n## memory trace of one step ({kind}, head_chunk_rows={args.head_chunk_rows}); before: {base:.2f} GiB")
    print("allocated above base, peak above base (GiB)")
    for what, allocated, peak in events:
        print(f"{allocated - base:7.2f} {peak - base:7.2f}  {what}")
    print_saved(saved, args.top, f"{kind}, head_chunk_rows={args.head_chunk_rows}")


def profile_gemms(torch, args) -> None:
    """The fused objective's two head GEMMs of one chunk at several chunk heights: the logits [2C, H] x [H, V] and
    the input gradient [C, V] x [V, H] (fp32 out, as the op writes it, and bf16 out); TFLOP/s, median of 10."""
    weight = torch.randn(args.vocab, args.hidden, device="cuda", dtype=torch.bfloat16)

    def timed(fn) -> float:
        return sorted(event_times_ms(fn, torch, 10, warmup=1))[5]

    print(f"\n## head GEMMs at hidden {args.hidden} / vocab {args.vocab}: ms and TFLOP/s of one chunk")
    print("rows  logits [2C,V]      dx fp32 out        dx bf16 out")
    for rows in (512, 1024, 1152, 1280, 1536, 2048):
        hidden = torch.randn(2 * rows, args.hidden, device="cuda", dtype=torch.bfloat16)
        dz = torch.randn(rows, args.vocab, device="cuda", dtype=torch.bfloat16)
        cells = []
        for fn, m in (
            (lambda: hidden @ weight.T, 2 * rows),
            (lambda: torch.mm(dz, weight, out_dtype=torch.float32), rows),
            (lambda: dz @ weight, rows),
        ):
            ms = timed(fn)
            cells.append(f"{ms:6.2f} {2 * m * args.hidden * args.vocab / ms / 1e9:5.0f}")
        print(f"{rows:5d} " + "     ".join(cells))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("objective", "step", "gemm"), required=True)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--vocab", type=int, default=129280)
    parser.add_argument("--blocks", type=int, default=1024)
    parser.add_argument("--head-chunk-rows", type=int, default=None)
    parser.add_argument("--native", action="store_true", help="step: the native drafter and objective")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()

    import torch

    if args.part == "objective":
        profile_objective(torch, args)
    elif args.part == "gemm":
        profile_gemms(torch, args)
    else:
        profile_step(torch, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
