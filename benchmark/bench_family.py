"""DeepSeek-family training-step benchmark on one GPU: native transformers ("hf"), liger-kernel ("liger", where it
has a patch for the model) and liger-dspine, at 2 layers of real widths (family_configs.py): DeepSeek-V2-Lite-like,
GLM-4.7-Flash-like and MiniCPM5-MoE-like (transformers 5.25) at 4096 and 16384 tokens, DeepSeek-V3.2-like at 4096 and
8192; DeepSeek-V4-Flash-like at 3 layers (sliding window, CSA, HCA; hash and learned routers), 4096, 7168 (the longest
that native and liger-kernel run) and 8192, liger-dspine with its defaults (the attention kernel and hyper-connections
included). ``--variant LABEL=JSON`` adds liger-dspine rows with other options (e.g. FP8), reported against the
defaults' rows.

The engine is bench_deepseek_v3.py's: one process per configuration, two warm-ups (the first timed from the built
model: first_step_s), the mean of three timed steps, peak memory over them, the loss of the last step (same model
and batch for every implementation). A model that the installed transformers or liger-dspine lacks is skipped with
a line saying so. With --max-seq (or --sweep-only) each implementation's longest sequence at batch 1 is searched too:
doubling from the model's first length, then bisection to --sweep-step tokens. Writes <out-dir>/family.csv, family.md
and family.png; the rows of the models, kinds (steps, longest sequence) and implementations run replace those
already in family.csv, so they can be run in separate commands.

    python benchmark/bench_family.py                                   # every model at its lengths
    python benchmark/bench_family.py --models deepseek_v32             # one model (needs transformers 5.24)
    python benchmark/bench_family.py --models deepseek_v4 --sweep-only # the longest sequences
    python benchmark/bench_family.py --tiny --models deepseek_v2 --lengths 4096   # CPU plumbing check
    python benchmark/bench_family.py --models deepseek_v2 --impls liger-dspine --variant 'fp8={"fp8": true}'
"""

import argparse
import json
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
        for seq in [] if args.sweep_only else _lengths(model, args):
            for impl, label, extra in _impl_variants(impls, args.variant):
                options = {**LIGER_DSPINE_OPTIONS.get(model, {}), **extra} if impl == "liger-dspine" else {}
                seq_len = TINY_SEQ[seq] if args.tiny else seq
                job = Job("throughput", impl, label, family_layers(model, LAYERS), seq_len, options, model)
                remaining = args.budget_s - (time.monotonic() - started)
                if impl == "liger" and not liger_kernel_serves(model):
                    rows.append(_job_row(job, status="unsupported: liger-kernel has no patch for this model"))
                elif remaining < MIN_CHILD_S:
                    logger.warning("skipping %s: %.0f s left in the budget", job, remaining)
                    rows.append(_job_row(job, status="skipped: time budget"))
                else:
                    logger.info("%s (timeout %.0f s)", job, min(args.child_timeout_s, remaining - 5))
                    rows += run_child(job, min(args.child_timeout_s, remaining - 5), args)
            write_rows(csv_path, _merged(csv_path, rows, args.fresh))
        if args.max_seq or args.sweep_only:
            rows += _sweeps(model, impls, started, args, csv_path, rows)
    rows = _merged(csv_path, rows, args.fresh)
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


def _sweeps(model: str, impls: list[str], started: float, args, csv_path: str, rows: list[dict]) -> list[dict]:
    """The longest sequence of each implementation at batch 1: doubling from the model's first benchmarked length,
    then bisection to ``--sweep-step`` tokens; the peers first, each sweep gets an equal share of what time is left."""
    args.sweep_start = FAMILY[model][3][0] if not args.tiny else 0
    order = sorted(impls, key=lambda i: ("liger", "hf", "liger-dspine").index(i))
    if not liger_kernel_serves(model):
        order = [i for i in order if i != "liger"]
    new: list[dict] = []
    for number, impl in enumerate(order):
        options = LIGER_DSPINE_OPTIONS.get(model, {}) if impl == "liger-dspine" else {}
        job = Job("max_seq", impl, impl, family_layers(model, LAYERS), 0, options, model)
        remaining = args.budget_s - (time.monotonic() - started)
        timeout = (remaining - 5) / (len(order) - number)
        if timeout < MIN_CHILD_S:
            logger.warning("skipping %s: %.0f s left in the budget", job, remaining)
            new.append(_job_row(job, status="skipped: time budget"))
            continue
        logger.info("%s (timeout %.0f s)", job, timeout)
        new += run_child(job, timeout, args)
        write_rows(csv_path, _merged(csv_path, rows + new, args.fresh))
    return new


def _impl_variants(impls: list[str], variants: list[str]) -> list[tuple[str, str, dict]]:
    """(impl, label, extra liger-dspine options) per step row: each implementation, then each ``LABEL=JSON``
    variant, liger-dspine with the model's options updated by the JSON object."""
    rows = [(impl, impl, {}) for impl in impls]
    for variant in variants:
        label, _, text = variant.partition("=")
        if not label or label in IMPLS:
            raise SystemExit(f"liger-dspine: --variant {variant!r} needs a new label, as in fp8='{{\"fp8\": true}}'")
        try:
            extra = json.loads(text)
        except json.JSONDecodeError as error:
            raise SystemExit(f"liger-dspine: --variant {label}: its options are not JSON ({error})") from None
        if not isinstance(extra, dict):
            raise SystemExit(f"liger-dspine: --variant {label}: its options must be a JSON object, got {text!r}")
        rows.append(("liger-dspine", label, extra))
    return rows


def _lengths(model: str, args) -> list[int]:
    chosen = [int(v) for v in _split(args.lengths)]
    return [seq for seq in FAMILY[model][3] if not chosen or seq in chosen]


def _merged(csv_path: str, rows: list[dict], fresh: bool) -> list[dict]:
    """This run's rows after the rows already in the CSV (unless ``fresh``) of the (model, kind, impl) triples it
    did not run: the step rows, the longest-sequence rows and each implementation of a model can come from separate
    commands. A model's "skipped" row (impl "-") goes whenever any implementation of that model and kind ran."""
    if fresh or not os.path.exists(csv_path):
        return list(rows)
    ran = {(r.get("model"), r.get("kind"), r.get("impl")) for r in rows}
    ran_kinds = {key[:2] for key in ran}

    def replaced(row: dict) -> bool:
        key = (row.get("model"), row.get("kind"))
        return (*key, row.get("impl")) in ran or (row.get("impl") == "-" and key in ran_kinds)

    kept = [r for r in read_rows([csv_path]) if not replaced(r)]
    return kept + list(rows)


def _split(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="", help=f"comma list of {', '.join(FAMILY)} (default: all)")
    parser.add_argument("--impls", default=",".join(IMPLS), help="comma list of hf, liger, liger-dspine")
    parser.add_argument("--lengths", default="", help="comma list of token counts to keep, e.g. 4096")
    parser.add_argument("--max-seq", action="store_true", help="also find each implementation's longest sequence")
    parser.add_argument("--sweep-only", action="store_true", help="only the longest-sequence sweep (no step rows)")
    parser.add_argument("--sweep-step", type=int, default=1024, help="resolution of the sweep (tokens)")
    parser.add_argument("--tiny", action="store_true", help="CPU plumbing check: tiny models, fp32, interpreter")
    parser.add_argument("--budget-s", type=float, default=540, help="stop starting processes past this (seconds)")
    parser.add_argument("--child-timeout-s", type=float, default=150, help="kill one configuration after this")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "data"))
    parser.add_argument("--name", default="family", help="file name stem (--tiny prefixes tiny_)")
    parser.add_argument("--fresh", action="store_true", help="do not keep other models' rows of an existing CSV")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument(
        "--variant", action="append", default=[], metavar="LABEL=JSON",
        help="also liger-dspine with these options over the model's (repeatable), e.g. fp8='{\"fp8\": true}'",
    )  # fmt: skip
    args = parser.parse_args(argv)
    args.sweep_start = 0  # what run_child passes on; _sweeps sets it per model
    if args.tiny:
        args.sweep_step = 0  # the tiny sweep's own resolution
    return args


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
