"""DeepSeek-V3 trained with liger-dspine's bf16 defaults and with ``fp8=True``, from the same weights on the same
batches: do the loss curves meet?

The goal of FP8 training: after 300 AdamW steps the FP8 run's loss within 0.5% (relative) of the bf16 run's, "at the
end" being the mean of the last 20 steps' losses. Both runs train bench_deepseek_v3.py's slim DeepSeek-V3 (real
widths, 16 routed experts top-2) at 2 layers, bf16 weights on the GPU, AdamW at a constant learning rate (3e-5: at
1e-4 the loss jumps from 13 to 20 over the first steps at these widths), on bytes of text: seeded windows, the same
batches in the same order. ``--corpus``: ``embedded`` is the package's 1.7 KB demo text
(``liger_dspine.demo.corpus_batches``); ``transformers-source`` (the default) the installed transformers' Python
sources in path order, tens of MB that 300 steps of 4096 tokens cannot learn by heart; or a glob of text files.
The model is built once; its initial state dict, kept in host memory, is loaded into the second run's model, which
is built after the first is freed. Per step: both losses. Per run: tokens/s over the steps after the first (forward,
backward and optimizer step) and the peak memory (weights, gradients and AdamW state included). The embedded text is
learnt by heart well before step 300 (loss about 0.04), where single steps' losses differ by several percent between
the runs; the plot shows the difference over the whole run.

--budget-s: the bf16 run stops at half of the budget left, the FP8 run after as many steps as the bf16 one made or
at the budget's end; what finished is written, and the table says the run stopped early. Exit code 0 when the
goal is met, 1 when not.

    python benchmark/bench_fp8_convergence.py            # one H100 / H200 (FP8 grouped GEMMs: sm 9.0 or 10.0)
    python benchmark/bench_fp8_convergence.py --tiny     # CPU check of the script: tiny model, fp32, reference path
    python benchmark/bench_fp8_convergence.py --replot benchmark/data/fp8_convergence.csv

Writes data/fp8_convergence{,_tiny}.{csv,md} and .png (with matplotlib).
"""

import argparse
import csv
import gc
import glob
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from dataclasses import field

import torch

if not torch.cuda.is_available():  # --tiny: Triton's CPU interpreter, switched on before any kernel module
    os.environ.setdefault("LIGER_DSPINE_INTERPRET", "1")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_deepseek_v3 import deepseek_v3_config  # noqa: E402
from bench_deepseek_v3 import model_class  # noqa: E402
from liger_dspine import apply_liger_kernel_to_deepseek_v3  # noqa: E402
from liger_dspine.demo import corpus_batches  # noqa: E402

GOAL = 0.005  # |FP8 end loss - bf16 end loss| / bf16 end loss
END_STEPS = 20  # the end loss: the mean of this many last steps
CORPUS_NAMES = {"embedded": "the embedded text", "transformers-source": "the installed transformers' sources"}
OUTPUT_RESERVE_S = 30  # of --budget-s: the second model's build and the files
FIELDS = ["step", "bf16_loss", "fp8_loss"]
# --tiny: every FP8 GEMM's dims multiples of 16 (kv_a_proj_with_mqa: kv_lora_rank + rope), a byte vocabulary
TINY_FP8_WIDTHS = dict(
    qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, kv_lora_rank=16, q_lora_rank=16, vocab_size=256
)


@dataclass
class Run:
    losses: list[float] = field(default_factory=list)
    tokens_per_s: float = float("nan")
    peak_gib: float = float("nan")


def corpus_files(corpus: str) -> list[str]:
    """The text files of ``--corpus`` (not ``embedded``), in path order."""
    if corpus == "transformers-source":
        import transformers

        corpus = os.path.join(os.path.dirname(transformers.__file__), "**", "*.py")
    files = sorted(glob.glob(corpus, recursive=True))
    if not files:
        raise SystemExit(f"bench_fp8_convergence.py: --corpus {corpus!r} matches no file")
    return files


def text_batches(corpus: str, seq_len: int, batch_size: int, steps: int, seed: int) -> list[torch.Tensor]:
    """[steps] batches of [batch_size, seq_len] byte ids: seeded windows of the corpus."""
    if corpus == "embedded":
        return corpus_batches(seq_len=seq_len, batch_size=batch_size, steps=steps, seed=seed)
    text = b"".join(open(path, "rb").read() for path in corpus_files(corpus))
    tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    if len(tokens) <= seq_len:
        raise SystemExit(f"bench_fp8_convergence.py: --corpus {corpus!r} holds {len(tokens)} bytes, not > --seq")
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(tokens) - seq_len, (steps, batch_size), generator=generator)
    return [torch.stack([tokens[start : start + seq_len] for start in row]) for row in starts]


def model_config(layers: int, tiny: bool, seq: int):
    if not tiny:
        return deepseek_v3_config(layers, False, seq)
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "test"))
    from tiny_models import tiny_deepseek_v3_config

    return tiny_deepseek_v3_config(
        num_hidden_layers=layers, max_position_embeddings=max(seq, 4096), attn_implementation=None, **TINY_FP8_WIDTHS
    )


def build(config, device: str, dtype: torch.dtype, state: dict | None):
    """The model built on the device in ``dtype`` (seed 0), with ``state`` loaded when given."""
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_class("deepseek_v3")(config)
    finally:
        torch.set_default_dtype(previous)
    if state is not None:
        model.load_state_dict(state)
    return model.train()


def train(model, batches, lr: float, deadline: float, device: str, label: str) -> Run:
    """AdamW steps over ``batches`` (at least one; none started past ``deadline``): losses, tokens/s, peak GiB."""
    cuda = device == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    run, timed_from = Run(), None
    for step, input_ids in enumerate(batches):
        if step and time.monotonic() > deadline:
            print(f"{label}: out of time after {step} steps")
            break
        input_ids = input_ids.to(device)
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        run.losses.append(loss.item())  # synchronises: the step is done
        if step == 0:  # the first step compiles the kernels: timed from its end
            timed_from = time.perf_counter()
        if step % 25 == 0 or step == len(batches) - 1:
            print(f"{label} step {step}: loss {run.losses[-1]:.4f}", flush=True)
    timed_steps = len(run.losses) - 1
    if timed_steps:
        run.tokens_per_s = timed_steps * batches[0].numel() / (time.perf_counter() - timed_from)
    if cuda:
        run.peak_gib = torch.cuda.max_memory_allocated() / 2**30
    return run


def end_loss(losses: list[float]) -> float:
    return statistics.mean(losses[-END_STEPS:])


def relative_difference(bf16: list[float], fp8: list[float]) -> float:
    """(FP8 end loss - bf16 end loss) / bf16 end loss over the steps both runs made."""
    steps = min(len(bf16), len(fp8))
    reference = end_loss(bf16[:steps])
    return (end_loss(fp8[:steps]) - reference) / reference


def write_csv(path: str, bf16: list[float], fp8: list[float]) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(FIELDS)
        for step, loss in enumerate(bf16):
            writer.writerow([step, f"{loss:.6f}", f"{fp8[step]:.6f}" if step < len(fp8) else ""])


def read_csv(path: str) -> tuple[list[float], list[float]]:
    with open(path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    return [float(r["bf16_loss"]) for r in rows], [float(r["fp8_loss"]) for r in rows if r["fp8_loss"]]


def summary(runs: dict[str, Run], args, device_name: str) -> str:
    bf16, fp8 = runs["bf16"], runs["fp8"]
    steps = min(len(bf16.losses), len(fp8.losses))
    difference = relative_difference(bf16.losses, fp8.losses)
    passed = abs(difference) < GOAL
    lines = [
        "| steps | bf16 end loss | FP8 end loss | relative difference | goal | result | bf16 tokens/s | FP8 tokens/s "
        "| bf16 peak GiB | FP8 peak GiB |",
        "|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|",
        f"| {steps} | {end_loss(bf16.losses[:steps]):.4f} | {end_loss(fp8.losses[:steps]):.4f} | "
        f"{difference:+.3%} | {GOAL:.1%} | {'pass' if passed else 'fail'} | {_cell(bf16.tokens_per_s, ',.0f')} | "
        f"{_cell(fp8.tokens_per_s, ',.0f')} | {_cell(bf16.peak_gib, '.2f')} | {_cell(fp8.peak_gib, '.2f')} |",
        "",
        f"End loss: the mean of the last {min(END_STEPS, steps)} steps' losses; relative difference: (FP8 - bf16) / "
        f"bf16. tokens/s: forward, backward and AdamW step, over the steps after the first.",
        f"DeepSeek-V3 {'tiny' if args.tiny else 'slim (real widths, 16 routed experts top-2)'}, {args.layers} layers, "
        f"batch {args.batch} x {args.seq} tokens of {CORPUS_NAMES.get(args.corpus, args.corpus)} (bytes), AdamW lr "
        f"{args.lr:g}, "
        f"{'fp32 on the CPU (FP8 reference path)' if args.tiny else 'bf16 weights'}; liger-dspine defaults against "
        f"fp8=True. Device: {device_name}, torch {torch.__version__}.",
    ]
    if steps < args.steps:
        lines.append(f"Stopped early (--budget-s {args.budget_s:g}): {steps} of {args.steps} steps.")
    return "\n".join(lines) + "\n"


def _cell(value: float, spec: str) -> str:
    return "-" if math.isnan(value) else format(value, spec)


def plot(bf16: list[float], fp8: list[float], path: str) -> str | None:
    """Both loss curves, and the relative difference per step with its mean over the last END_STEPS steps."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    steps = range(len(fp8))
    figure, (loss_axis, difference_axis) = plt.subplots(1, 2, figsize=(12, 4.5))
    loss_axis.plot(range(len(bf16)), bf16, label="bf16 (liger-dspine defaults)", linewidth=1)
    loss_axis.plot(steps, fp8, label="fp8=True", linewidth=1)
    loss_axis.set(title="training loss", xlabel="step", ylabel="loss", yscale="log")
    loss_axis.legend()
    difference = [100 * (f - b) / b for b, f in zip(bf16, fp8)]
    window = [statistics.mean(difference[max(0, i - END_STEPS + 1) : i + 1]) for i in steps]
    difference_axis.plot(steps, difference, linewidth=0.8, alpha=0.5, label="per step")
    difference_axis.plot(steps, window, linewidth=1.5, label=f"mean of the last {END_STEPS} steps")
    for sign in (1, -1):
        difference_axis.axhline(sign * 100 * GOAL, color="black", linestyle=":", linewidth=1)
    difference_axis.axhline(0, color="black", linewidth=0.6)
    difference_axis.set(title="(FP8 - bf16) / bf16 loss; goal: within 0.5% at the end", xlabel="step", ylabel="%")
    difference_axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny model on the CPU, fp32, few steps")
    parser.add_argument("--steps", type=int, help="AdamW steps of each run (default 300, 4 with --tiny)")
    parser.add_argument("--seq", type=int, help="tokens per row (default 1024, 16 with --tiny)")
    parser.add_argument("--batch", type=int, help="rows per step (default 4, 1 with --tiny)")
    parser.add_argument("--lr", type=float, help="AdamW learning rate (default 3e-5, 3e-3 with --tiny)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    parser.add_argument(
        "--corpus",
        help="embedded, transformers-source or a glob of text files (default transformers-source; --tiny: embedded)",
    )
    parser.add_argument("--budget-s", type=float, help="seconds for both runs (run_gpu.sh passes it); default none")
    parser.add_argument("--out", default=os.path.join(HERE, "data"), help="where the files go (default benchmark/data)")
    parser.add_argument("--replot", metavar="CSV", help="redraw the plot of a CSV this script wrote, and exit")
    args = parser.parse_args(argv)
    defaults = dict(steps=4, seq=16, batch=1, lr=3e-3, corpus="embedded")
    if not args.tiny:
        defaults = dict(steps=300, seq=1024, batch=4, lr=3e-5, corpus="transformers-source")
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.replot:
        print(plot(*read_csv(args.replot), args.replot.replace(".csv", ".png")) or "matplotlib missing: no plot")
        return 0
    started = time.monotonic()
    deadline = started + args.budget_s if args.budget_s is not None else math.inf
    cuda = not args.tiny and torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    if not args.tiny and not cuda:
        raise SystemExit("bench_fp8_convergence.py needs a CUDA GPU with FP8 (sm 9.0 or 10.0); --tiny runs on a CPU")
    config = model_config(args.layers, args.tiny, args.seq)
    batches = text_batches(args.corpus, seq_len=args.seq, batch_size=args.batch, steps=args.steps, seed=0)
    runs, initial = {}, None
    for label, fp8 in (("bf16", False), ("fp8", True)):
        model = build(config, device, dtype, initial)
        if initial is None:
            initial = {name: tensor.detach().to("cpu", copy=True) for name, tensor in model.state_dict().items()}
        print(apply_liger_kernel_to_deepseek_v3(model=model, fp8=fp8))
        if label == "bf16":  # half of what is left, so that the FP8 run can make as many steps
            run_deadline, run_batches = time.monotonic() + (deadline - time.monotonic() - OUTPUT_RESERVE_S) / 2, batches
        else:
            run_deadline, run_batches = deadline - OUTPUT_RESERVE_S, batches[: len(runs["bf16"].losses)]
        runs[label] = train(model, run_batches, args.lr, run_deadline, device, label)
        del model
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, "fp8_convergence" + ("_tiny" if args.tiny else ""))
    write_csv(stem + ".csv", runs["bf16"].losses, runs["fp8"].losses)
    report = summary(runs, args, torch.cuda.get_device_name() if cuda else "cpu")
    with open(stem + ".md", "w") as handle:
        handle.write(report)
    print(report)
    plotted = plot(runs["bf16"].losses, runs["fp8"].losses, stem + ".png")
    written = f"{stem}.csv, {stem}.md" + (f", {plotted}" if plotted else "")
    print(f"wrote {written} in {time.monotonic() - started:.0f} s")
    return 0 if abs(relative_difference(runs["bf16"].losses, runs["fp8"].losses)) < GOAL else 1


if __name__ == "__main__":
    raise SystemExit(main())
