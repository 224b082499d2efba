"""The FP8 quantisers alone: how close each comes to the GPU's memory bandwidth, at the shapes of the DeepSeek-V3 step.

A quantiser only moves bytes (it reads a bf16 operand once or twice and writes its fp8 values and fp32 scales), so
its floor is a copy of the same bytes. For each operand the FP8 step quantises (``bench_deepseek_v3.py``'s slim
DeepSeek-V3 at 4096 tokens: the MLA and MLP weights, the 16 routed experts' weights, the activations), this times,
side by side in one run:

- ``triton``: the op of ``liger_dspine.ops.fp8_quantize`` (rows, columns or group columns);
- ``torch``: the same quantisation written in torch (its reference function), eager;
- ``baseline`` (with ``--baseline FILE``): the op of another version of ``ops/fp8_quantize.py``;
- ``copy``: ``torch.Tensor.copy_`` of as many bytes as the op must move at least (one read of the input, one write
  of the fp8 values), the bandwidth a quantiser could reach.

and reports each one's GB/s on the bytes it must move, and the op's share of the copy's rate.

    python benchmark/bench_fp8_quantize.py           # a GPU
    python benchmark/bench_fp8_quantize.py --baseline OLD/fp8_quantize.py   # and another version, side by side
    python benchmark/bench_fp8_quantize.py --tiny    # CPU check of the script (no timing)

Writes data/fp8_quantize{,_tiny}.{csv,md} and .png (with matplotlib).
"""

import argparse
import os
import statistics

import torch

if not torch.cuda.is_available():  # --tiny: Triton's CPU interpreter, switched on before any kernel module
    os.environ.setdefault("LIGER_DSPINE_INTERPRET", "1")
from baseline_module import load_baseline  # noqa: E402
from cuda_timing import event_times_ms  # noqa: E402
from liger_dspine.ops.fp8_quantize import column_amax_reference  # noqa: E402
from liger_dspine.ops.fp8_quantize import quantize_columns  # noqa: E402
from liger_dspine.ops.fp8_quantize import quantize_columns_reference  # noqa: E402
from liger_dspine.ops.fp8_quantize import quantize_group_columns  # noqa: E402
from liger_dspine.ops.fp8_quantize import quantize_group_columns_reference  # noqa: E402
from liger_dspine.ops.fp8_quantize import quantize_rowwise  # noqa: E402
from liger_dspine.ops.fp8_quantize import quantize_rowwise_reference  # noqa: E402
from report import write_csv_and_markdown  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
# the baseline file's functions by layout (its torch references: the same names with "_reference")
ENTRY_POINTS = {"rows": "quantize_rowwise", "columns": "quantize_columns", "group columns": "quantize_group_columns"}
FIELDS = ["operand", "layout", "shape", "impl", "ms", "gb_per_s", "of_copy"]

# (operand, layout, shape, groups): what one FP8 step of the slim DeepSeek-V3 quantises, 4096 tokens
OPERANDS = [
    ("x, hidden (4096 x 7168)", "rows", (4096, 7168), 0),
    ("x, hidden (4096 x 7168)", "columns", (4096, 7168), 0),
    ("o_proj weight (7168 x 16384)", "rows", (7168, 16384), 0),
    ("o_proj weight (7168 x 16384)", "columns", (7168, 16384), 0),
    ("q_b_proj weight (24576 x 1536)", "rows", (24576, 1536), 0),
    ("q_b_proj weight (24576 x 1536)", "columns", (24576, 1536), 0),
    ("mlp gate+up weight (36864 x 7168)", "rows", (36864, 7168), 0),
    ("mlp gate+up weight (36864 x 7168)", "columns", (36864, 7168), 0),
    ("experts gate+up (16 x 4096 x 7168)", "rows", (16 * 4096, 7168), 0),
    ("experts gate+up (16 x 4096 x 7168)", "columns", (16, 4096, 7168), 0),
    ("experts gate+up (16 x 4096 x 7168)", "rows + column amax", (16, 4096, 7168), 0),
    ("experts gate+up (16 x 4096 x 7168)", "columns, amax given", (16, 4096, 7168), 0),
    ("experts down (16 x 7168 x 2048)", "rows", (16 * 7168, 2048), 0),
    ("experts down (16 x 7168 x 2048)", "columns", (16, 7168, 2048), 0),
    ("expert rows, hidden (8192 x 7168)", "group columns", (8192, 7168), 16),
    ("expert rows, gate+up grad (8192 x 4096)", "group columns", (8192, 4096), 16),
]
TINY_OPERANDS = [
    ("tiny", "rows", (40, 96), 0),
    ("tiny", "columns", (2, 40, 96), 0),
    ("tiny", "group columns", (40, 96), 4),
    ("tiny", "rows + column amax", (2, 40, 96), 0),
    ("tiny", "columns, amax given", (2, 40, 96), 0),
]


# per layout: (the op, its torch reference, the op's arguments beyond x); "rows + column amax" is the forward's rows
# pass over a stack of expert weights that also finds each expert's column amax, "columns, amax given" the
# backward's column pass that takes it (its amax pass skipped)
OPS = {
    "rows": (quantize_rowwise, quantize_rowwise_reference, lambda x: ()),
    "columns": (quantize_columns, quantize_columns_reference, lambda x: ()),
    "group columns": (quantize_group_columns, quantize_group_columns_reference, lambda x: ()),
    "rows + column amax": (
        lambda x: quantize_rowwise(x, with_column_amax=True),
        lambda x: (*quantize_rowwise_reference(x), column_amax_reference(x)),
        lambda x: (),
    ),
    "columns, amax given": (quantize_columns, quantize_columns_reference, lambda x: (column_amax_reference(x),)),
}


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    as_bits = (lambda t: t.view(torch.uint8)) if a.dtype == torch.float8_e4m3fn else (lambda t: t)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_bits(a), as_bits(b))


def min_bytes(shape, dtype) -> int:
    """One read of the input and one write of its fp8 values."""
    elements = 1
    for size in shape:
        elements *= size
    return elements * (torch.empty((), dtype=dtype).element_size() + 1)


def measure(operand, layout, shape, groups, device, repeats, baseline=None):
    generator = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x = torch.randn(shape, device=device, generator=generator).to(dtype)
    kernel, reference, extra = OPS[layout]
    args = (x, *extra(x))
    if groups:  # even routing
        args = (x, torch.arange(1, groups + 1, device=device, dtype=torch.int32) * (shape[0] // groups))
    nbytes = min_bytes(shape, dtype)
    source = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    paths = {"triton": lambda: kernel(*args), "torch": lambda: reference(*args), "copy": lambda: target.copy_(source)}
    with_baseline = baseline is not None and layout in ENTRY_POINTS  # the layouts every version has
    if with_baseline:
        paths["baseline"] = lambda op=getattr(baseline, ENTRY_POINTS[layout]): op(*args)
    checks = {"triton": reference}  # each version's kernels against its own torch reference, bit for bit
    if with_baseline:
        checks["baseline"] = getattr(baseline, ENTRY_POINTS[layout] + "_reference")
    for impl, its_reference in checks.items():
        if not all(map(bit_equal, paths[impl](), its_reference(*args))):
            raise AssertionError(f"{operand} {layout}: the {impl} quantiser's output differs from the torch reference")
    rows, copy_ms = [], None
    for impl, function in paths.items():
        ms = statistics.median(event_times_ms(function, torch, repeats, warmup=3)) if device == "cuda" else float("nan")
        copy_ms = ms if impl == "copy" else copy_ms
        rows.append(dict(operand=operand, layout=layout, shape="x".join(map(str, shape)), impl=impl, ms=ms,
                         gb_per_s=nbytes / ms / 1e6))  # fmt: skip
    for row in rows:
        row["of_copy"] = copy_ms / row["ms"]
        print(f"{operand:>42} {layout:>13} {row['impl']:>6}: {row['ms']:8.3f} ms {row['gb_per_s']:7.0f} GB/s "
              f"({row['of_copy']:.0%} of a copy)")  # fmt: skip
    return rows


def plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    labels = [f"{r['operand']}, {r['layout']}" for r in rows if r["impl"] == "copy"]
    figure, axis = plt.subplots(figsize=(9, 0.35 * len(labels) + 1.5))
    height = 0.27
    for i, impl in enumerate(("triton", "torch", "copy")):  # (a baseline's rows are in the table)
        values = [r["gb_per_s"] for r in rows if r["impl"] == impl]
        axis.barh([j + (i - 1) * height for j in range(len(values))], values, height, label=impl)
    axis.set_yticks(range(len(labels)), labels, fontsize=7)
    axis.invert_yaxis()
    axis.set(xlabel="GB/s on the bytes a quantiser must move (read bf16 once, write fp8 once)")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (no timing)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=os.path.join(HERE, "data"))
    parser.add_argument("--baseline", help="another version of ops/fp8_quantize.py, measured beside this one")
    parser.add_argument("--budget-s", type=float, help="accepted for run_gpu.sh")
    args = parser.parse_args(argv)
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    operands = TINY_OPERANDS if args.tiny else OPERANDS
    baseline = load_baseline(args.baseline, "baseline_fp8_quantize") if args.baseline else None
    rows = []
    for operand in operands:
        rows += measure(*operand, device, args.repeats, baseline)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, "fp8_quantize" + ("_tiny" if args.tiny else ""))
    impls = ["triton", "torch", "copy"] + (["baseline"] if args.baseline else [])
    by_case = {}
    for r in rows:
        by_case.setdefault((r["operand"], r["layout"]), {})[r["impl"]] = r
    lines = ["| operand | layout | " + " | ".join(f"{i} ms" for i in impls) + " | triton GB/s | "
             + " | ".join(f"{i} / copy" for i in impls if i != "copy") + " |",
             "|---|---|" + "---:|" * (2 * len(impls))]  # fmt: skip
    complete = [c for c in by_case.values() if all(i in c for i in impls)]  # a baseline lacks the newer layouts
    total_label = "all of the above" if len(complete) == len(by_case) else "all with a baseline row"
    for (operand, layout), case in list(by_case.items()) + [((total_label, ""), None)]:
        if case is None:  # totals
            case = {i: dict(ms=sum(c[i]["ms"] for c in complete)) for i in impls}
            for i in impls:
                case[i]["of_copy"] = case["copy"]["ms"] / case[i]["ms"]
            case["triton"]["gb_per_s"] = float("nan")
        ms = [f"{case[i]['ms']:.3f}" if i in case else "-" for i in impls]
        shares = [f"{case[i]['of_copy']:.0%}" if i in case else "-" for i in impls if i != "copy"]
        lines.append(f"| {operand} | {layout} | " + " | ".join(ms) + f" | {case['triton']['gb_per_s']:.0f} | "
                     + " | ".join(shares) + " |")  # fmt: skip
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    lines += ["", f"device: {device_name}, torch {torch.__version__}; GB/s on one bf16 read and one fp8 write"]
    write_csv_and_markdown(stem, FIELDS, rows, lines)
    plotted = plot(rows, stem + ".png") if device == "cuda" else None
    print(f"wrote {stem}.csv, {stem}.md" + (f", {plotted}" if plotted else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
