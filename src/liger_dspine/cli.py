"""Command line: ``liger-dspine demo`` and ``liger-dspine inspect CONFIG``."""

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
    args = parser.parse_args(argv)

    _setup_device(args.cpu_interpreter)
    if args.command == "demo":
        from liger_dspine.demo import run_demo
        from liger_dspine.demo_dspine import run_dspine_demo

        deepseek_v3 = run_demo(steps=args.steps, seed=args.seed)
        dspine = run_dspine_demo(steps=args.steps, seed=args.seed)
        return deepseek_v3 or dspine
    return _inspect(args.config)


def _setup_device(force_interpreter: bool) -> None:
    import torch

    if force_interpreter or not torch.cuda.is_available():
        os.environ["LIGER_DSPINE_INTERPRET"] = "1"
        from liger_dspine import enable_cpu_interpreter

        enable_cpu_interpreter()


def _inspect(config_arg: str) -> int:
    import torch
    from transformers import AutoConfig

    from liger_dspine import apply_liger_kernel_to_instance
    from liger_dspine.auto_model import causal_lm_from_config

    if os.path.exists(config_arg):
        path = os.path.dirname(config_arg) if config_arg.endswith(".json") else config_arg
        config = AutoConfig.from_pretrained(path)
    else:
        config = AutoConfig.for_model(config_arg)
    with torch.device("meta"):
        model = causal_lm_from_config(config)
    print(apply_liger_kernel_to_instance(model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
