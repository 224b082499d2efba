"""Command line: ``liger-dspine demo``, ``liger-dspine inspect CONFIG``, ``liger-dspine convert SOURCE [DEST]`` and
``liger-dspine train-drafter [...]``."""

import argparse
import os
import re
import sys

DESCRIPTION = (
    "Liger kernels for DeepSeek-family models and DSpine speculative-decoding drafters. Training runs on a GPU; on a "
    "CPU the Triton kernels run through Triton's interpreter (about 500x slower than eager), for development and tests."
)
TRAIN_DRAFTER = (
    "Train a DSpine drafter against a frozen target (a checkpoint folder, or random weights from a config), capturing "
    "its hidden states on the fly; checkpoints in SpecForge's layout go to --output-dir/checkpoint-STEP. --tiny is a "
    "CPU-sized run of a tiny random target."
)


def build_parser() -> argparse.ArgumentParser:
    """Every command and option, each option's help ending with its default."""
    parser = argparse.ArgumentParser(prog="liger-dspine", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument(
        "--cpu-interpreter",
        action="store_true",
        help="run Triton kernels on the CPU through Triton's interpreter (automatic when no CUDA device is present)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", help="train a tiny DeepSeek-V3, then a tiny DSpine drafter, natively and patched on embedded text"
    )
    demo.add_argument("--steps", type=_positive_int, default=None, help="training steps of each model")
    demo.add_argument("--seed", type=int, default=0, help="seed of the weights and the data order")
    inspect = sub.add_parser("inspect", help="print what the patch replaces for a model config")
    inspect.add_argument("config", help="a config.json, a checkpoint folder, or a model type such as deepseek_v3")
    convert = sub.add_parser(
        "convert",
        help='write a DSpine drafter folder of the older model_type "dspine" layout in SpecForge\'s, then check it',
    )
    convert.add_argument("source", help="a DSpine checkpoint folder")
    convert.add_argument("destination", nargs="?", help="the folder to write (new or empty)")
    convert.add_argument(
        "--check",
        action="store_true",
        help="only check SOURCE: config, weight keys and shapes (a train-drafter --output-dir: its latest checkpoint)",
    )
    from liger_dspine.drafter_training import options

    train = sub.add_parser(
        "train-drafter",
        help="train a DSpine drafter against a frozen target (SpecForge format)",
        description=TRAIN_DRAFTER,
    )
    options.add_arguments(train)
    from liger_dspine.drafter_training import eval_options

    evaluate = sub.add_parser("eval-drafter", help="a DSpine drafter's acceptance length against its target")
    eval_options.add_arguments(evaluate)
    _state_defaults(parser)
    _state_defaults(evaluate, eval_options.STATED_DEFAULTS)
    from liger_dspine.drafter_training import generate_command

    generate = sub.add_parser("generate", help="speculative decoding of one prompt with a DSpine drafter")
    generate_command.add_arguments(generate)
    _state_defaults(generate, generate_command.STATED_DEFAULTS)
    from liger_dspine.drafter_training import capture_command

    capture = sub.add_parser("capture", help="write a target's taps of a dataset to disk for train-drafter --taps")
    capture_command.add_arguments(capture)
    _state_defaults(capture, capture_command.STATED_DEFAULTS)
    _state_defaults(demo, {"steps": "8 for the DeepSeek-V3 demo, 30 for the DSpine demo"})
    _state_defaults(convert)
    _state_defaults(train, {**options.DEFAULTS, **options.DERIVED_DEFAULTS}, options.TINY)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "convert":
        return _convert(args.source, args.destination, args.check)
    if args.command == "train-drafter":
        try:
            early = _before_training(args)
        except ValueError as error:
            if not str(error).startswith("liger-dspine:"):
                raise
            print(error, file=sys.stderr)
            return 2
        if early is not None:
            return early

    _setup_device(args.cpu_interpreter)
    if args.command == "demo":
        from liger_dspine.demo import run_demo
        from liger_dspine.demo_dspine import run_dspine_demo

        deepseek_v3 = run_demo(**_given(steps=args.steps), seed=args.seed)
        dspine = run_dspine_demo(**_given(steps=args.steps), seed=args.seed)
        return deepseek_v3 or dspine
    if args.command == "train-drafter":
        return _train_drafter(args)
    if args.command == "eval-drafter":
        from liger_dspine.drafter_training.eval_command import main as eval_drafter

        return eval_drafter(args)
    if args.command == "generate":
        from liger_dspine.drafter_training.generate_command import main as generate

        return generate(args)
    if args.command == "capture":
        from liger_dspine.drafter_training.capture_command import main as capture

        return capture(args)
    return _inspect(args.config)


def _setup_device(force_interpreter: bool) -> None:
    import torch

    if force_interpreter or not torch.cuda.is_available():
        os.environ["LIGER_DSPINE_INTERPRET"] = "1"
        from liger_dspine import enable_cpu_interpreter

        enable_cpu_interpreter()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version

    try:
        return version("liger-dspine")
    except PackageNotFoundError:
        return "(not installed)"


def _given(**values) -> dict:
    return {key: value for key, value in values.items() if value is not None}


def _state_defaults(parser: argparse.ArgumentParser, defaults: dict | None = None, preset: dict | None = None) -> None:
    """End every option's help with its default (and the --tiny preset's value where it differs), in plain text."""
    defaults, preset = defaults or {}, preset or {}
    for action in parser._actions:
        if not action.option_strings or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        if action.dest in defaults:
            default = defaults[action.dest]
        elif isinstance(action.default, bool):
            default = "on" if action.default else "off"
        else:
            default = "none" if action.default is None else action.default
        text = f"default: {default}"
        if action.dest in preset and str(preset[action.dest]) != str(default):
            text += f"; --tiny: {preset[action.dest]}"
        action.help = f"{action.help} ({text})" if action.help else text


def _before_training(args) -> int | None:
    """Check the arguments, say where checkpoints go, and stop when a resumed run has nothing left to do; all before
    anything is loaded. Returns an exit status to stop with, or None to train."""
    from liger_dspine.drafter_training.options import resolve
    from liger_dspine.drafter_training.state import latest_checkpoint

    resolve(args)
    if os.environ.get("RANK", "0") != "0":
        return None
    folder = os.path.abspath(args.output_dir)
    latest = latest_checkpoint(folder) if args.resume else None
    if latest is not None:
        done = int(re.search(r"(\d+)$", latest).group(1))
        if done >= args.steps:
            print(f"train-drafter: {latest} is step {done} of --steps {args.steps}: nothing to do (raise --steps)")
            return 0
    print(f"train-drafter: checkpoints go to {folder}" + (f", resuming from {latest}" if latest else ""), flush=True)
    return None


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
    checkpoints = _checkpoints(source)
    if checkpoints and not os.path.isfile(os.path.join(source, "config.json")):
        names = ", ".join(os.path.basename(path) for path in checkpoints)
        if not check_only:
            print(
                f"liger-dspine: {source} is a train-drafter output folder ({names}): convert one of them",
                file=sys.stderr,
            )
            return 2
        print(f"{source} is a train-drafter output folder ({names}): checking the latest, {checkpoints[-1]}")
        source = checkpoints[-1]
    try:
        report = check_checkpoint(source) if check_only else convert_checkpoint(source, destination)
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    print(report)
    return 0 if report.ok else 1


def _checkpoints(folder: str) -> list[str]:
    """The checkpoint-STEP folders of a train-drafter --output-dir, by step."""
    if not os.path.isdir(folder):
        return []
    steps = sorted(int(m.group(1)) for m in map(re.compile(r"^checkpoint-(\d+)$").match, os.listdir(folder)) if m)
    return [os.path.join(folder, f"checkpoint-{step}") for step in steps]


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
