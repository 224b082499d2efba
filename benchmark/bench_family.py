"""DeepSeek-family training-step benchmark on one GPU: native transformers ("hf"), liger-kernel ("liger", where it
has a patch for the model) and liger-dspine, at 2 layers of real widths (family_configs.py): DeepSeek-V2-Lite-like
and GLM-4.7-Flash-like at 4096 and 16384 tokens, DeepSeek-V3.2-like at 4096 and 8192; DeepSeek-V4-Flash-like at 3
layers (sliding window, CSA, HCA; hash and learned routers), 4096 and 8192, liger-dspine with its opt-in attention
kernel and hyper-connections.

The engine is bench_deepseek_v3.py's: one process per configuration, two warm-ups (the first timed from the built
model: first_step_s), the mean of three timed steps, peak memory over them, the loss of the last step (same model
and batch for every implementation). A model that the installed transformers or liger-dspine lacks is skipped with
a line saying so. Writes <out-dir>/family.csv, family.md and family.png; the rows of the models run replace those
models' rows already in family.csv, so the models can be run in separate commands.

    python benchmark/bench_family.py                                   # every model at its lengths
    python benchmark/bench_family.py --models deepseek_v32             # one model (needs transformers 5.24)
    python benchmark/bench_family.py --tiny --models deepseek_v2 --lengths 4096   # CPU plumbing check
"""

import argparse
import logging
import os
import sys
import time

from bench_deepseek_v3 import IMPLS
from bench_deepseek_v3 import MIN_CHILD_S
from bench_deepseek_v3 import TINY_SEQ
from bench_deepseek_v3 import Job
from bench_deepseek_v3 import _job_row
from bench_deepseek_v3 import run_child
from family_configs import FAMILY
from family_configs import LAYER_PLANS
from family_configs import LIGER_DSPINE_OPTIONS
from family_configs import family_layers
from family_configs import liger_kernel_serves
from family_configs import why_not_available
from family_report import family_markdown
from family_report import family_plot
from report import read_rows
from report import write_rows

logger = logging.getLogger("bench_family")
LAYERS = 2


def run(args) -> int:
    started = time.monotonic()
    name = f"tiny_{args.name}" if args.tiny else args.name
    os.makedirs(args.out_dir, exist_ok=True)
    csv_path = os.path.join(args.out_dir, f"{name}.csv")
    models = _split(args.models) or list(FAMILY)
    impls = _split(args.impls)
    unknown = [m for m in models if m not in FAMILY] + [i for i in impls if i not in IMPLS]
    if unknown:
        raise SystemExit(f"liger-dspine: unknown model or implementation {unknown}; models: {', '.join(FAMILY)}")
    rows: list[dict] = []
    for model in models:
        why = why_not_available(model, args.tiny)
        if why:
            logger.warning("skipping %s: %s", model, why)
            rows.append(
                dict(kind="throughput", model=model, impl="-", layers=family_layers(model, LAYERS), seq=0,
                     status=f"skipped: {why}")
            )  # fmt: skip
            continue
        if model in LAYER_PLANS:
            logger.info("%s layer plan: %s", model, LAYER_PLANS[model])
        for seq in _lengths(model, args):
            for impl in impls:
                options = LIGER_DSPINE_OPTIONS.get(model, {}) if impl == "liger-dspine" else {}
                seq_len = TINY_SEQ[seq] if args.tiny else seq
                job = Job("throughput", impl, impl, family_layers(model, LAYERS), seq_len, options, model)
                remaining = args.budget_s - (time.monotonic() - started)
                if impl == "liger" and not liger_kernel_serves(model):
                    rows.append(_job_row(job, status="unsupported: liger-kernel has no patch for this model"))
                elif remaining < MIN_CHILD_S:
                    logger.warning("skipping %s: %.0f s left in the budget", job, remaining)
                    rows.append(_job_row(job, status="skipped: time budget"))
                else:
                    logger.info("%s (timeout %.0f s)", job, min(args.child_timeout_s, remaining - 5))
                    rows += run_child(job, min(args.child_timeout_s, remaining - 5), args)
            write_rows(csv_path, _merged(csv_path, rows, models, args.fresh))
    rows = _merged(csv_path, rows, models, args.fresh)
    write_rows(csv_path, rows)
    report = family_markdown(rows)
    with open(os.path.join(args.out_dir, f"{name}.md"), "w") as handle:
        handle.write(report)
    print(report, flush=True)
    if not args.no_plots:
        path = family_plot(rows, os.path.join(args.out_dir, f"{name}.png"))
        logger.info("wrote %s", path or "no plot (matplotlib is missing)")
    logger.info("wrote %s (%.0f s in all)", csv_path, time.monotonic() - started)
    return 0


def _lengths(model: str, args) -> list[int]:
    chosen = [int(v) for v in _split(args.lengths)]
    return [seq for seq in FAMILY[model][3] if not chosen or seq in chosen]


def _merged(csv_path: str, rows: list[dict], models: list[str], fresh: bool) -> list[dict]:
    """This run's rows after the rows of other models already in the CSV (unless ``fresh``)."""
    if fresh or not os.path.exists(csv_path):
        return list(rows)
    kept = [r for r in read_rows([csv_path]) if r.get("model") not in models]
    return kept + list(rows)


def _split(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="", help=f"comma list of {', '.join(FAMILY)} (default: all)")
    parser.add_argument("--impls", default=",".join(IMPLS), help="comma list of hf, liger, liger-dspine")
    parser.add_argument("--lengths", default="", help="comma list of token counts to keep, e.g. 4096")
    parser.add_argument("--tiny", action="store_true", help="CPU plumbing check: tiny models, fp32, interpreter")
    parser.add_argument("--budget-s", type=float, default=540, help="stop starting processes past this (seconds)")
    parser.add_argument("--child-timeout-s", type=float, default=150, help="kill one configuration after this")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "data"))
    parser.add_argument("--name", default="family", help="file name stem (--tiny prefixes tiny_)")
    parser.add_argument("--fresh", action="store_true", help="do not keep other models' rows of an existing CSV")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    args.sweep_start = 0  # what run_child passes on; no sweep here
    return args


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
