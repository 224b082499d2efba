"""The GEMMs of one DeepSeek-V3 layer in bf16 against the FP8 rowwise ops, forward + backward, on the GPU.

The first measurement behind FP8 training: for each GEMM of a DeepSeek-V3 layer at 4096 tokens (the MLA
projections, the dense MLP, the shared expert and the routed experts' grouped GEMMs at 256 experts top-8, routed
evenly, and at the step benchmark's 16 experts top-2), the time of the bf16 GEMM (``F.linear`` /
``torch._grouped_mm`` with autograd) and of ``fp8_linear`` / ``fp8_grouped_mm`` (quantisation of both operands
included), forward and backward. ``weight quant`` is the part of the FP8 time spent quantising the weight (once
rowwise for the forward, once per column for the input gradient): what FP8 copies of the weights kept across the
micro-batches of an optimizer step would save. The per-layer sums say how much of the step's GEMM time FP8 takes
off; the error against an fp64 product says what it costs in accuracy.

    python benchmark/bench_fp8_gemm.py            # a GPU with FP8 (sm 8.9+)
    python benchmark/bench_fp8_gemm.py --tiny     # CPU check of the script: tiny shapes, the reference path
    python benchmark/bench_fp8_gemm.py --profile  # also: each FP8 path's kernels, by CUDA time (torch.profiler)

Writes data/fp8_gemm{,_tiny}.{csv,md} (and .png with matplotlib).
"""

import argparse
import os
import statistics

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # --tiny: Triton's CPU interpreter, switched on before any kernel module
    os.environ.setdefault("LIGER_DSPINE_INTERPRET", "1")
from cuda_timing import event_times_ms  # noqa: E402
from liger_dspine.ops.fp8_grouped_mm import fp8_grouped_mm  # noqa: E402
from liger_dspine.ops.fp8_linear import fp8_linear  # noqa: E402
from liger_dspine.ops.fp8_quantize import quantize_columns  # noqa: E402
from liger_dspine.ops.fp8_quantize import quantize_rowwise  # noqa: E402
from report import write_csv_and_markdown  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
FIELDS = ["gemm", "tokens", "out", "in", "groups", "impl", "fwd_bwd_ms", "tflops", "rel_error"]

# (name, out features, in features, groups, top-k): DeepSeek-V3's projections; groups > 0: routed experts
DEEPSEEK_V3_GEMMS = [
    ("q_a_proj", 1536, 7168, 0, 1),
    ("q_b_proj", 24576, 1536, 0, 1),
    ("kv_a_proj_with_mqa", 576, 7168, 0, 1),
    ("kv_b_proj", 32768, 512, 0, 1),
    ("o_proj", 7168, 16384, 0, 1),
    ("mlp gate+up", 36864, 7168, 0, 1),
    ("mlp down", 7168, 18432, 0, 1),
    ("shared gate+up", 4096, 7168, 0, 1),
    ("shared down", 7168, 2048, 0, 1),
    ("experts gate+up", 4096, 7168, 256, 8),
    ("experts down", 7168, 2048, 256, 8),
    ("slim experts gate+up", 4096, 7168, 16, 2),  # bench_deepseek_v3.py's 16 experts top-2
    ("slim experts down", 7168, 2048, 16, 2),
]
# the GEMMs of each kind of layer: MLA, then the dense MLP or the shared and routed experts
MLA = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
SHARED = ("shared gate+up", "shared down")
LAYERS = {
    "dense layer": (*MLA, "mlp gate+up", "mlp down"),
    "MoE layer": (*MLA, *SHARED, "experts gate+up", "experts down"),
    "slim MoE layer": (*MLA, *SHARED, "slim experts gate+up", "slim experts down"),
}
REFERENCE_GROUPS = 4  # routed experts: the float64 reference covers the rows of this many groups
TINY_GEMMS = [("linear", 32, 64, 0, 1), ("experts", 32, 48, 4, 2)]


def grouped_bf16(x, weight, offs):
    """Rows of group e times weight[e].T: torch's grouped GEMM for bf16 on CUDA, a per-group loop otherwise (the
    fp64 reference; the grouped GEMM takes no fp64)."""
    grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm
    if x.is_cuda and x.dtype == torch.bfloat16:
        return grouped_mm(x, weight.transpose(1, 2), offs=offs)
    starts = [0] + offs[:-1].tolist()
    return torch.cat([x[s:e] @ weight[g].t() for g, (s, e) in enumerate(zip(starts, offs.tolist()))])


def inputs(out_features, in_features, groups, top_k, tokens, device, generator):
    rows = tokens * top_k
    x = torch.randn(rows, in_features, device=device, generator=generator).bfloat16().requires_grad_()
    shape = (groups, out_features, in_features) if groups else (out_features, in_features)
    weight = (torch.randn(shape, device=device, generator=generator) * in_features**-0.5).bfloat16().requires_grad_()
    grad = torch.randn(rows, out_features, device=device, generator=generator).bfloat16()
    offs = None
    if groups:  # even routing: each expert gets rows / groups rows
        offs = torch.arange(1, groups + 1, device=device, dtype=torch.int32) * (rows // groups)
    return x, weight, grad, offs


def timed_ms(function, repeats: int) -> float:
    """The median CUDA time of ``function()``; on a CPU one call and no timing."""
    if not torch.cuda.is_available():
        function()
        return float("nan")
    return statistics.median(event_times_ms(function, torch, repeats, warmup=3))


def quantize_weight(weight):
    """What the FP8 ops do to a weight in one forward + backward: rowwise over K, then per column over N."""
    if weight.dim() == 3:
        experts, out_features, in_features = weight.shape
        quantize_rowwise(weight.reshape(experts * out_features, in_features))
    else:
        quantize_rowwise(weight)
    quantize_columns(weight)


def kernel_table(function, name: str, steps: int = 5) -> str:
    """The CUDA kernels of ``steps`` calls of ``function``, by total time per call (torch.profiler)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile

    function()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            function()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    lines = [f"## {name}: kernels of one FP8 forward + backward"]
    for e in sorted(events, key=lambda e: -e.self_device_time_total):
        lines.append(f"{e.self_device_time_total / steps / 1000:8.3f} ms  x{e.count // steps:<3} {e.key[:110]}")
    return "\n".join(lines)


def measure(name, out_features, in_features, groups, top_k, tokens, device, repeats, profile_to=None):
    generator = torch.Generator(device=device).manual_seed(0)
    x, weight, grad, offs = inputs(out_features, in_features, groups, top_k, tokens, device, generator)
    if groups:  # the error over the first groups' rows: a float64 copy of every expert would not fit
        kept = min(groups, REFERENCE_GROUPS)
        kept_rows = int(offs[kept - 1])
        reference = grouped_bf16(x[:kept_rows].double(), weight[:kept].double(), offs[:kept])
    else:
        kept_rows = x.shape[0]
        reference = x.double() @ weight.double().t()
    paths = {
        "bf16": (lambda: grouped_bf16(x, weight, offs)) if groups else (lambda: F.linear(x, weight)),
        "fp8": (lambda: fp8_grouped_mm(x, weight, offs)) if groups else (lambda: fp8_linear(x, weight)),
    }
    rows = []
    flops = 3 * 2 * x.shape[0] * out_features * in_features  # forward, input gradient, weight gradient
    for impl, forward in paths.items():

        def step(forward=forward):
            x.grad = weight.grad = None
            forward().backward(grad)

        ms = timed_ms(step, repeats)
        if profile_to is not None and impl == "fp8" and device == "cuda":
            profile_to.append(kernel_table(step, name))
            print(profile_to[-1])
        with torch.no_grad():
            out = forward()[:kept_rows].double()
        error = float((out - reference).norm() / reference.norm())
        rows.append(
            dict(
                gemm=name, tokens=tokens, out=out_features, groups=groups, impl=impl, fwd_bwd_ms=ms, rel_error=error,
                tflops=flops / ms / 1e9 if ms == ms else float("nan"), **{"in": in_features},
            )
        )  # fmt: skip
        print(f"{name:>20} {impl:>4}: {ms:8.3f} ms, {rows[-1]['tflops']:7.1f} TFLOP/s, rel. error {error:.2e}")
    with torch.no_grad():
        ms = timed_ms(lambda: quantize_weight(weight.detach()), repeats)
    rows.append(
        dict(
            gemm=name, tokens=tokens, out=out_features, groups=groups, impl="weight quant", fwd_bwd_ms=ms,
            rel_error=float("nan"), tflops=float("nan"), **{"in": in_features},
        )
    )  # fmt: skip
    print(f"{name:>20} weight quant: {ms:8.3f} ms")
    return rows


def plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = [r["gemm"] for r in rows if r["impl"] == "bf16"]
    speedup = [
        b["fwd_bwd_ms"] / f["fwd_bwd_ms"]
        for b, f in zip([r for r in rows if r["impl"] == "bf16"], [r for r in rows if r["impl"] == "fp8"])
    ]
    figure, axis = plt.subplots(figsize=(8, 4))
    axis.barh(names, speedup)
    axis.axvline(1.0, color="black", linewidth=0.8)
    axis.set(xlabel="bf16 time / FP8 time (forward + backward)", title="DeepSeek-V3 layer GEMMs, 4096 tokens")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (no timing)")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=os.path.join(HERE, "data"))
    parser.add_argument("--profile", action="store_true", help="each FP8 path's kernels (fp8_gemm_kernels.txt)")
    parser.add_argument("--budget-s", type=float, help="accepted for run_gpu.sh")
    args = parser.parse_args(argv)
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    gemms, tokens = (TINY_GEMMS, 16) if args.tiny else (DEEPSEEK_V3_GEMMS, args.tokens)
    rows, tables = [], [] if args.profile else None
    for gemm in gemms:
        rows += measure(*gemm, tokens, device, args.repeats, tables)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, "fp8_gemm" + ("_tiny" if args.tiny else ""))
    if tables:
        with open(stem + "_kernels.txt", "w") as handle:
            handle.write("\n\n".join(tables) + "\n")
    bf16 = {r["gemm"]: r for r in rows if r["impl"] == "bf16"}
    fp8 = {r["gemm"]: r for r in rows if r["impl"] == "fp8"}
    quant = {r["gemm"]: r for r in rows if r["impl"] == "weight quant"}
    lines = [
        "| GEMM | bf16 ms | FP8 ms | bf16 / FP8 | of which weight quant ms | bf16 / FP8 less weight quant | "
        "FP8 TFLOP/s | FP8 rel. error | bf16 rel. error |"
    ]
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")

    def ratios(b_ms, f_ms, q_ms):
        return f"{b_ms:.3f} | {f_ms:.3f} | {b_ms / f_ms:.2f}x | {q_ms:.3f} | {b_ms / (f_ms - q_ms):.2f}x"

    for name in bf16:
        b, f, q = bf16[name], fp8[name], quant[name]
        lines.append(
            f"| {name} | {ratios(b['fwd_bwd_ms'], f['fwd_bwd_ms'], q['fwd_bwd_ms'])} | {f['tflops']:.0f} | "
            f"{f['rel_error']:.2e} | {b['rel_error']:.2e} |"
        )
    for layer, parts in LAYERS.items():
        if not args.tiny:
            names = parts
            total_b, total_f, total_q = (sum(d[name]["fwd_bwd_ms"] for name in names) for d in (bf16, fp8, quant))
            lines.append(f"| {layer}, its GEMMs | {ratios(total_b, total_f, total_q)} | | | |")
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    lines += ["", f"device: {device_name}, {tokens} tokens, torch {torch.__version__}"]
    write_csv_and_markdown(stem, FIELDS, rows, lines)
    plotted = plot(rows, stem + ".png") if device == "cuda" else None
    print(f"wrote {stem}.csv, {stem}.md" + (f", {plotted}" if plotted else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
