"""Arguments of ``liger-dspine eval-drafter``: one typed record, its defaults, help and checks in one place.

Everything is checked before a model or a file's content is loaded.
"""

import argparse
import os
from dataclasses import dataclass
from dataclasses import field
from dataclasses import fields


@dataclass
class EvalDrafterOptions:
    """What ``eval-drafter`` evaluates and how (see ``add_arguments`` for each field's meaning)."""

    drafter: str
    dataset: str
    target: str | None = None
    target_config: str | None = None
    target_layers: int | None = None
    tokenizer: str | None = None
    max_prompt_length: int = 512
    new_tokens: int = 64
    max_prompts: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    end_to_end: bool = True
    output_dir: str | None = None
    liger: bool = True
    dtype: str = "auto"
    seed: int = 0

    def __post_init__(self):
        check(self)


def fail(message: str):
    raise ValueError(f"liger-dspine: {message}")


def check(options: EvalDrafterOptions) -> None:
    """A ValueError naming the first bad argument."""
    if not os.path.isdir(options.drafter):
        fail(f"the drafter {options.drafter!r} is not a folder (a train-drafter checkpoint or a SpecForge export)")
    if not os.path.isfile(os.path.join(options.drafter, "config.json")):
        fail(f"the drafter folder {options.drafter!r} has no config.json")
    if not os.path.isfile(options.dataset):
        fail(f"--dataset {options.dataset!r} is not a file")
    if options.target and options.target_config:
        fail("give --target or --target-config, not both")
    if not options.target and not options.target_config:
        fail("eval-drafter needs the drafter's target: --target FOLDER or --target-config tiny|CONFIG.json")
    if options.target and not os.path.isdir(options.target):
        fail(f"--target {options.target!r} is not a folder")
    if options.target_config and options.target_config != "tiny" and not os.path.isfile(options.target_config):
        fail(f"--target-config {options.target_config!r} is neither 'tiny' nor a config file")
    for name in ("max_prompt_length", "new_tokens", "max_prompts", "target_layers"):
        value = getattr(options, name)
        if value is not None and value < 1:
            fail(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if any(stop < 0 for stop in options.stop_token_ids):
        fail(f"--stop-token-ids must be token ids (>= 0), got {options.stop_token_ids}")
    if options.dtype not in ("auto", "float32", "bfloat16"):
        fail(f"--dtype must be auto, float32 or bfloat16, got {options.dtype!r}")


# What the help states as each option's default where the parser's default value does not say it.
STATED_DEFAULTS = {
    "dataset": "required",
    "tokenizer": "the --target folder",
    "max_prompts": "every line",
    "stop_token_ids": "none",
    "dtype": "auto, bfloat16 on CUDA and float32 on a CPU",
    "target_config": "none; give it or --target",
    "target": "none; give it or --target-config",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("drafter", help="the drafter's folder (config.json and safetensors weights)")
    parser.add_argument(
        "--dataset",
        required=True,
        help="held-out JSONL, as train-drafter reads it; a line's prompt is its tokens before the first supervised "
        "one (a conversation's prompt turns), or the whole line when it starts supervised",
    )
    parser.add_argument("--target", help="the target's checkpoint folder")
    parser.add_argument(
        "--target-config", help="random weights from a config ('tiny' or a config.json), seeded with --seed"
    )
    parser.add_argument("--target-layers", type=int, help="override num_hidden_layers of --target-config")
    parser.add_argument("--tokenizer", help="tokenizer folder for chat messages")
    parser.add_argument("--max-prompt-length", type=int, default=512, help="prompt tokens kept at most (the first)")
    parser.add_argument(
        "--new-tokens",
        type=int,
        default=64,
        help="continuation tokens per prompt: the offline anchors, and spec_generate's max_new_tokens",
    )
    parser.add_argument("--max-prompts", type=int, help="evaluate the first N lines only")
    parser.add_argument("--stop-token-ids", default="", help="comma-separated stop tokens of the end-to-end generation")
    parser.add_argument(
        "--end-to-end", action=argparse.BooleanOptionalAction, default=True, help="also run spec_generate"
    )
    parser.add_argument("--output-dir", help="write acceptance.json, acceptance.csv and acceptance.png here")
    parser.add_argument(
        "--liger", action=argparse.BooleanOptionalAction, default=True, help="Liger kernels in drafter and target"
    )
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto", help="models' dtype")
    parser.add_argument("--seed", type=int, default=0, help="seed of a --target-config target's random weights")


def from_namespace(args: argparse.Namespace) -> EvalDrafterOptions:
    """The options of parsed arguments (the stop tokens parsed from their comma-separated list)."""
    values = {f.name: getattr(args, f.name) for f in fields(EvalDrafterOptions) if hasattr(args, f.name)}
    text = values.get("stop_token_ids") or ""
    try:
        values["stop_token_ids"] = [int(token) for token in text.split(",") if token.strip()]
    except ValueError:
        fail(f"--stop-token-ids must be comma-separated integers, got {text!r}")
    return EvalDrafterOptions(**values)
