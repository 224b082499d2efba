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
    demo.add_argument("--steps", type=int, default=8)
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
    import torch
    from transformers import AutoConfig

    from liger_dspine import apply_liger_kernel_to_instance
    from liger_dspine.auto_model import causal_lm_from_config

    if os.path.exists(config_arg):
        path = os.path.dirname(config_arg) if config_arg.endswith(".json") else config_arg
        config = AutoConfig.from_pretrained(path)
    else:
        config = AutoConfig.for_model(config_arg, **_PATCHED_DEFAULTS.get(config_arg, {}))
        filled = _fill_unset_expert_counts(config.get_text_config(decoder=True))
        if filled:
            taken = ", ".join(f"{name}={value}" for name, value in filled.items())
            print(f"(the default {type(config).__name__} leaves expert counts unset; taken to build it: {taken})")
    with torch.device("meta"):
        model = causal_lm_from_config(config)
    print(apply_liger_kernel_to_instance(model))
    return 0


# by model type: what the default config needs to be the model the patch covers (mistral3: Mistral-Small-4)
_PATCHED_DEFAULTS = {"mistral3": {"text_config": {"model_type": "mistral4"}}}


def _fill_unset_expert_counts(config) -> dict[str, int]:
    """Expert counts some configs leave None by default (Dots1Config), set to the smallest a grouped router takes
    (two experts per group); the modules they size are built all the same."""
    smallest = {
        "n_routed_experts": 2 * (getattr(config, "n_group", None) or 1),
        "num_experts_per_tok": 1,
        "n_shared_experts": 1,
    }
    filled = {name: n for name, n in smallest.items() if hasattr(config, name) and getattr(config, name) is None}
    for name, value in filled.items():
        setattr(config, name, value)
    return filled


if __name__ == "__main__":
    sys.exit(main())
