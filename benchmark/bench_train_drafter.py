"""``train-drafter`` on the GPU: a slim DeepSeek-V3 target at real widths, a 2-layer DSpine drafter, the embedded text.

The target is ``bench_deepseek_v3.py``'s DeepSeek-V3 (hidden 7168, vocab 129280, MLA, 16 routed experts) at 4 layers
with random weights, tapped at ``[0, 1, 2, 3]``; bf16, Liger kernels and the fused objective. The run passes when the
mean loss of the last 10 steps is at least 10% below that of the first 10. Per step: time, peak memory, and the
capture's time (synchronised around it inside the loop). Writes ``train_drafter_steps.csv`` (one row per step) and
``train_drafter.csv`` (the summary) and ``train_drafter_loss.png`` under benchmark/data/.

    python benchmark/bench_train_drafter.py           # H200
    python benchmark/bench_train_drafter.py --tiny    # CPU plumbing check: the demo's tiny target, fp32
"""

import argparse
import csv
import os
import shutil
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data")
SUMMARY = ["steps", "seq", "first10_loss", "last10_loss", "drop", "median_step_s", "capture_share", "peak_gib",
           "tokens_per_s", "passed"]  # fmt: skip


def plot(steps_csv: str, png: str) -> None:
    """Loss per step and step time of a run's ``train_drafter_steps*.csv``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(steps_csv, newline="") as handle:
        rows = list(csv.DictReader(handle))
    steps = [int(row["step"]) for row in rows]
    figure, (loss_axis, time_axis) = plt.subplots(1, 2, figsize=(11, 4))
    loss_axis.plot(steps, [float(row["loss"]) for row in rows], marker=".")
    loss_axis.set(title="DSpine drafter loss", xlabel="step", ylabel="loss")
    time_axis.plot(steps[1:], [float(row["step_s"]) for row in rows[1:]], marker=".", label="step")
    time_axis.plot(steps[1:], [float(row["capture_s"]) for row in rows[1:]], marker=".", label="target capture")
    time_axis.set(title="time per step (after the first)", xlabel="step", ylabel="s")
    time_axis.legend()
    figure.tight_layout()
    figure.savefig(png, dpi=110)
    plt.close(figure)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replot", help="redraw the plot of a train_drafter_steps CSV this script wrote, and exit")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--budget-s", type=float, help="accepted for run_gpu.sh; the run is bounded by --steps")
    args = parser.parse_args()
    if args.replot:
        plot(args.replot, args.replot.replace("_steps", "_loss").replace(".csv", ".png"))
        return 0

    sys.path.insert(0, HERE)
    from liger_dspine.cli import _setup_device

    _setup_device(False)  # before any kernel module is imported
    from liger_dspine.drafter_training.loop import train_drafter
    from liger_dspine.drafter_training.options import add_arguments
    from liger_dspine.drafter_training.options import resolve

    work = tempfile.mkdtemp(prefix="train-drafter-")
    if args.tiny:
        target = ["--tiny"]
    else:
        from bench_deepseek_v3 import deepseek_v3_config

        config_path = os.path.join(work, "config.json")
        deepseek_v3_config(4, False, args.seq).to_json_file(config_path)
        target = ["--target-config", config_path, "--target-layer-ids", "0,1,2,3", "--dtype", "bfloat16"]
    steps_csv = os.path.join(work, "steps.csv")
    argv = [*target, "--drafter-layers", "2", "--steps", str(args.steps), "--seq-len", str(args.seq),
            "--lr", str(args.lr), "--output-dir", os.path.join(work, "out"), "--metrics-csv", steps_csv]  # fmt: skip
    if args.tiny:
        argv += ["--no-liger"]
    train_parser = argparse.ArgumentParser()
    add_arguments(train_parser)
    history = train_drafter(resolve(train_parser.parse_args(argv)))

    losses = [row["loss"] for row in history]
    first, last = statistics.mean(losses[:10]), statistics.mean(losses[-10:])
    timed = history[1:] or history  # the first step includes kernel compilation
    summary = {
        "steps": len(history),
        "seq": args.seq,
        "first10_loss": round(first, 4),
        "last10_loss": round(last, 4),
        "drop": round(1 - last / first, 4),
        "median_step_s": round(statistics.median(row["step_s"] for row in timed), 4),
        "capture_share": round(sum(row["capture_s"] for row in timed) / sum(row["step_s"] for row in timed), 4),
        "peak_gib": round(max(row["peak_gib"] for row in history), 2),
        "tokens_per_s": round(statistics.median(row["tokens_per_s"] for row in timed), 1),
        "passed": last <= 0.9 * first,
    }
    os.makedirs(DATA, exist_ok=True)
    suffix = "_tiny" if args.tiny else ""
    shutil.copy(steps_csv, os.path.join(DATA, f"train_drafter_steps{suffix}.csv"))
    try:
        plot(steps_csv, os.path.join(DATA, f"train_drafter_loss{suffix}.png"))
    except ImportError:
        print("matplotlib missing: no plot")
    with open(os.path.join(DATA, f"train_drafter{suffix}.csv"), "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=SUMMARY)
        writer.writeheader()
        writer.writerow(summary)
    print("\n".join(f"{key}: {value}" for key, value in summary.items()))
    shutil.rmtree(work, ignore_errors=True)
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
