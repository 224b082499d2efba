"""Command line: ``liger-dspine demo``, ``liger-dspine inspect CONFIG``, ``liger-dspine convert SOURCE [DEST]`` and
``liger-dspine train-drafter [...]``."""

import argparse
import os
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="liger-dspine", description=__doc__)
    parser.add_argument(
        "--cpu-interpreter",
        action="store_true",
        help="run Triton kernels on the CPU through Triton's interpreter (automatic when no CUDA device is present)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", help="train a tiny DeepSeek-V3, then a tiny DSpine drafter, natively and patched on embedded text"
    )
    demo.add_argument("--steps", type=_positive_int, default=8, help="training steps of each model (default 8)")
    demo.add_argument("--seed", type=int, default=0)
    inspect = sub.add_parser("inspect", help="print what the patch replaces for a model config")
    inspect.add_argument("config", help="a config.json, a checkpoint folder, or a model type such as deepseek_v3")
    convert = sub.add_parser(
        "convert",
        help='write a DSpine drafter folder of the older model_type "dspine" layout in SpecForge\'s, then check it',
    )
    convert.add_argument("source", help="a DSpine checkpoint folder")
    convert.add_argument("destination", nargs="?", help="the folder to write (new or empty)")
    convert.add_argument("--check", action="store_true", help="only check SOURCE: config, weight keys and shapes")
    from liger_dspine.drafter_training.options import add_arguments

    add_arguments(
        sub.add_parser("train-drafter", help="train a DSpine drafter against a frozen target (SpecForge format)")
    )
    args = parser.parse_args(argv)
    if args.command == "convert":
        return _convert(args.source, args.destination, args.check)

    _setup_device(args.cpu_interpreter)
    if args.command == "demo":
        from liger_dspine.demo import run_demo
        from liger_dspine.demo_dspine import run_dspine_demo

        deepseek_v3 = run_demo(steps=args.steps, seed=args.seed)
        dspine = run_dspine_demo(steps=args.steps, seed=args.seed)
        return deepseek_v3 or dspine
    if args.command == "train-drafter":
        return _train_drafter(args)
    return _inspect(args.config)


def _setup_device(force_interpreter: bool) -> None:
    import torch

    if force_interpreter or not torch.cuda.is_available():
        os.environ["LIGER_DSPINE_INTERPRET"] = "1"
        from liger_dspine import enable_cpu_interpreter

        enable_cpu_interpreter()


def _train_drafter(args) -> int:
    from liger_dspine.drafter_training import run

    try:
        return run(args)
    except ValueError as error:
        if not str(error).startswith(("liger-dspine:", "DSpine ")):  # the drafter config's own checks name DSpine
            raise
        print(error if str(error).startswith("liger-dspine:") else f"liger-dspine: {error}", file=sys.stderr)
        return 2


def _convert(source: str, destination: str | None, check_only: bool) -> int:
    from liger_dspine.models.dspine.checkpoint import check_checkpoint
    from liger_dspine.models.dspine.checkpoint import convert_checkpoint

    if not check_only and destination is None:
        print("liger-dspine: convert needs a destination folder (or --check to only check SOURCE)", file=sys.stderr)
        return 2
    try:
        report = check_checkpoint(source) if check_only else convert_checkpoint(source, destination)
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    print(report)
    return 0 if report.ok else 1


def _inspect(config_arg: str) -> int:
    from liger_dspine.cli_inspect import inspect_report

    try:
        lines = inspect_report(config_arg)
    except (ValueError, TypeError) as error:
        if not str(error).startswith("liger-dspine:"):
            raise
        print(error, file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


if __name__ == "__main__":
    sys.exit(main())
