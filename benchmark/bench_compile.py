"""torch.compile of DeepSeek-V3 (and family models), native and patched by liger-dspine: throughput, memory, compile
time, graph breaks.

Four configurations per model at 2 layers / 4096 tokens (bench_deepseek_v3.py's model: real widths, 16 routed
experts, bf16; a family model at bench_family.py's widths), each in a process of its own: native eager, native
compiled, liger-dspine eager, liger-dspine compiled
(``torch.compile(model)``, inductor). A configuration times one training step (forward and backward, no
optimizer) from the built model (first_step_s: compilation included when compiled), one warm-up, then the mean
of ``--steps`` timed steps; peak memory over the timed steps. A compiled configuration first takes one eager step
on the same weights and batch, and reports how far its first compiled step's loss and gradients are from it
(loss_diff = |compiled - eager|, grad_rel_diff = max |compiled - eager| / max |eager| over every parameter), and
the graph breaks and graphs dynamo counted.

The forward passes ``use_cache=False``, as ``Trainer`` sets it (``TrainingArguments.use_cache``); ``--use-cache``
returns the cache instead. A compiled graph returns the cached latents as outputs of their own that get no gradient,
and autograd fills a zero gradient for each (4.5 MiB per MLA layer at 4096 tokens in bf16), where eager's cache
holds tensors of the loss's graph.

Writes <out-dir>/compile.csv and compile.png (compile_tiny.* with --tiny).

    python benchmark/bench_compile.py                 # H200
    python benchmark/bench_compile.py --models deepseek_v3,glm4_moe_lite --family-impls liger-dspine
    python benchmark/bench_compile.py --tiny          # CPU plumbing check: tiny model, fp32, Triton's interpreter
"""

import argparse
import csv
import json
import logging
import os
import subprocess
import sys
import tempfile
import time

logger = logging.getLogger("bench_compile")
HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = (("native", "eager"), ("native", "compiled"), ("liger-dspine", "eager"), ("liger-dspine", "compiled"))
FIELDS = (
    "model",
    "impl",
    "mode",
    "layers",
    "seq",
    "tokens_per_s",
    "peak_gib",
    "first_step_s",
    "graph_breaks",
    "graphs",
    "use_cache",
    "loss",
    "loss_diff",
    "grad_rel_diff",
    "status",
)


def child(args) -> dict:
    if args.tiny:
        os.environ["LIGER_DSPINE_INTERPRET"] = "1"
        import liger_dspine  # noqa: F401  (switches the interpreter on before any kernel module is imported)
    import torch
    from torch._dynamo.utils import counters

    sys.path.insert(0, HERE)
    from bench_deepseek_v3 import model_class
    from bench_deepseek_v3 import model_config

    cuda = not args.tiny
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    config = model_config(args.model, args.layers, args.tiny, args.seq)
    torch.manual_seed(0)
    model = model_class(args.model)(config).to(device=device, dtype=dtype).train()
    if args.impl == "liger-dspine":
        from family_configs import LIGER_DSPINE_OPTIONS
        from liger_dspine import MODEL_TYPE_TO_APPLY_LIGER_FN

        MODEL_TYPE_TO_APPLY_LIGER_FN[args.model](model=model, **LIGER_DSPINE_OPTIONS.get(args.model, {}))
    ids = torch.randint(0, config.vocab_size, (1, args.seq), device=device)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def step(forward):
        model.zero_grad(set_to_none=True)
        loss = forward(ids, labels=ids, use_cache=args.use_cache).loss
        loss.backward()
        return loss.detach()

    row = dict(
        model=args.model, impl=args.impl, mode=args.mode, layers=args.layers, seq=args.seq, use_cache=args.use_cache
    )
    forward = model
    if args.mode == "compiled":
        eager_loss = step(model).float()
        eager_grads = {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None}
        torch._dynamo.reset()
        counters.clear()
        forward = torch.compile(model)
    sync()
    started = time.perf_counter()
    loss = step(forward)
    sync()
    row["first_step_s"] = time.perf_counter() - started
    row["loss"] = float(loss)
    if args.mode == "compiled":
        row["graph_breaks"] = sum(counters["graph_break"].values())
        row["graphs"] = counters["stats"]["unique_graphs"]
        row["loss_diff"] = abs(float(loss) - float(eager_loss))
        worst = scale = 0.0
        for name, p in model.named_parameters():
            if p.grad is None or name not in eager_grads:
                continue
            reference = eager_grads[name]
            worst = max(worst, float((p.grad.float().cpu() - reference).abs().max()))
            scale = max(scale, float(reference.abs().max()))
        row["grad_rel_diff"] = worst / scale if scale else worst
        del eager_grads
    step(forward)  # warm-up
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    sync()
    started = time.perf_counter()
    for _ in range(args.steps):
        step(forward)
    sync()
    row["tokens_per_s"] = args.seq * args.steps / (time.perf_counter() - started)
    if cuda:
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    row["status"] = "ok"
    return row


def run_all(args) -> list[dict]:
    rows = []
    deadline = time.monotonic() + args.budget_s
    configs = [
        (model, impl, mode)
        for model in args.models
        for impl, mode in CONFIGS
        if impl in (args.impls if model == "deepseek_v3" else args.family_impls)
    ]
    for model, impl, mode in configs:
        left = deadline - time.monotonic()
        base = dict(model=model, impl=impl, mode=mode, layers=args.layers, seq=args.seq, use_cache=args.use_cache)
        if left < 30:
            rows.append(dict(base, status="skipped: out of time"))
            continue
        with tempfile.NamedTemporaryFile("r", suffix=".json") as result:
            command = [sys.executable, __file__, "--child", impl, mode, result.name, "--models", model]
            command += child_flags(args)
            logger.info("%s %s %s (%.0f s left)", model, impl, mode, left)
            env = dict(os.environ, LIGER_FUSED_MOE_AUTOTUNE="0")
            try:
                subprocess.run(command, timeout=left - 10, check=True, env=env)
                rows.append(json.load(open(result.name)))
            except subprocess.TimeoutExpired:
                rows.append(dict(base, status="timeout"))
            except (subprocess.CalledProcessError, json.JSONDecodeError) as error:
                rows.append(dict(base, status=f"error: {type(error).__name__}"))
        logger.info("%s", rows[-1])
    return rows


def child_flags(args) -> list[str]:
    flags = ["--layers", str(args.layers), "--seq", str(args.seq), "--steps", str(args.steps)]
    return flags + (["--tiny"] if args.tiny else []) + (["--use-cache"] if args.use_cache else [])


def write_csv(path: str, rows: list[dict]) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=FIELDS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: f"{v:.6g}" if isinstance(v, float) else v for k, v in row.items() if k in FIELDS})


def plot(path: str, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if r.get("status") == "ok"]
    labels = [f"{r['model']}\n{r['impl']}\n{r['mode']}" for r in done]
    figure, axes = plt.subplots(1, 3, figsize=(max(13, 1.4 * len(done) * 3), 4.5))
    for axis, key, title in zip(
        axes, ("tokens_per_s", "peak_gib", "first_step_s"), ("tokens/s", "peak GiB", "first step (s)")
    ):
        colors = {("native", "eager"): "#888", ("native", "compiled"): "#555", ("liger-dspine", "eager"): "#4a8"}
        axis.bar(
            labels, [r.get(key) or 0 for r in done], color=[colors.get((r["impl"], r["mode"]), "#286") for r in done]
        )
        axis.set_title(title)
        axis.tick_params(axis="x", labelsize=8)
    seq, layers = rows[0]["seq"], rows[0]["layers"]
    figure.suptitle(f"{layers} layers, {seq} tokens: eager vs torch.compile")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny model on a CPU (interpreter)")
    parser.add_argument("--models", default="deepseek_v3", help="comma-separated: deepseek_v3 and family models")
    parser.add_argument("--impls", default="native,liger-dspine", help="the implementations run for DeepSeek-V3")
    parser.add_argument(
        "--family-impls", default="native,liger-dspine", help="the implementations run for models other than V3"
    )
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=None, help="tokens per step (default 4096, 16 with --tiny)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 3, 1 with --tiny)")
    parser.add_argument("--use-cache", action="store_true", help="the forward returns the cache (default: no cache)")
    parser.add_argument("--budget-s", type=float, default=560)
    parser.add_argument("--out-dir", default=os.path.join(HERE, "data"))
    parser.add_argument("--name", default="compile", help="the output files' name (.csv, .png)")
    parser.add_argument("--child", nargs=3, metavar=("IMPL", "MODE", "RESULT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.seq = args.seq or (16 if args.tiny else 4096)
    args.steps = args.steps or (1 if args.tiny else 3)
    args.models = args.models.split(",")
    args.impls, args.family_impls = args.impls.split(","), args.family_impls.split(",")
    if args.child:
        args.model = args.models[0]
    return args


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args = parse_args(argv)
    if args.child:
        args.impl, args.mode, result = args.child
        row = child(args)
        with open(result, "w") as handle:
            json.dump(row, handle)
        return 0
    rows = run_all(args)
    os.makedirs(args.out_dir, exist_ok=True)
    name = f"{args.name}_tiny" if args.tiny else args.name
    write_csv(os.path.join(args.out_dir, f"{name}.csv"), rows)
    plot(os.path.join(args.out_dir, f"{name}.png"), rows)
    for row in rows:
        logger.info("%s", {k: row.get(k) for k in FIELDS})
    return 0 if all(r.get("status") == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
