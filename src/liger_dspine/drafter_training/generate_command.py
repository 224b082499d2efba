"""``liger-dspine generate``: speculative decoding of one prompt with a drafter folder and its target.

Prints the generated text (token ids without a tokenizer), then the acceptance statistics. Arguments are checked
before anything is loaded.
"""

import argparse
import os
import sys

# What the help states as each option's default where the parser's default value does not say it.
STATED_DEFAULTS = {
    "target": "none; give it or --target-config",
    "target_config": "none; give it or --target",
    "tokenizer": "the --target folder",
    "prompt": "none; give it or --prompt-ids",
    "prompt_ids": "none; give it or --prompt",
    "stop_token_ids": "the target's eos_token_id",
    "dtype": "auto, bfloat16 on CUDA and float32 on a CPU",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("drafter", help="the drafter's folder (config.json and safetensors weights)")
    parser.add_argument("--target", help="the target's checkpoint folder")
    parser.add_argument("--target-config", help="random weights from a config ('tiny' or a config.json)")
    parser.add_argument("--target-layers", type=int, help="override num_hidden_layers of --target-config")
    parser.add_argument("--tokenizer", help="tokenizer folder of --prompt and of the printed text")
    parser.add_argument("--prompt", help="the prompt's text")
    parser.add_argument("--prompt-ids", help="the prompt's comma-separated token ids")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above: speculative sampling")
    parser.add_argument("--stop-token-ids", help="comma-separated stop tokens ('' for none)")
    parser.add_argument("--plain", action="store_true", help="draft the argmax of the drafter's logits, unrefined")
    parser.add_argument("--liger", action=argparse.BooleanOptionalAction, default=True, help="Liger kernels")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto", help="models' dtype")
    parser.add_argument("--seed", type=int, default=0, help="seed of sampling and of a --target-config's weights")


def _ids(text: str, name: str) -> list[int]:
    try:
        return [int(token) for token in text.split(",") if token.strip()]
    except ValueError:
        raise ValueError(f"liger-dspine: {name} must be comma-separated integers, got {text!r}") from None


def _check(args) -> None:
    def fail(message):
        raise ValueError(f"liger-dspine: {message}")

    if not os.path.isfile(os.path.join(args.drafter, "config.json")):
        fail(f"the drafter {args.drafter!r} is not a folder with a config.json")
    if bool(args.target) == bool(args.target_config):
        fail("generate needs the drafter's target: --target FOLDER or --target-config tiny|CONFIG.json (one)")
    if args.target and not os.path.isdir(args.target):
        fail(f"--target {args.target!r} is not a folder")
    if bool(args.prompt) == bool(args.prompt_ids):
        fail("give the prompt as --prompt TEXT or --prompt-ids IDS (one)")
    if args.prompt and not (args.tokenizer or args.target):
        fail("--prompt needs a tokenizer: --tokenizer FOLDER, or a --target folder with one")
    if args.max_new_tokens < 1:
        fail(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not 0 <= args.temperature < float("inf"):
        fail(f"--temperature must be a finite number >= 0, got {args.temperature}")


def run(args) -> int:
    import torch

    from liger_dspine.drafter_training import setup
    from liger_dspine.drafter_training.eval_command import _device_and_dtype
    from liger_dspine.drafter_training.eval_command import load_drafter

    _check(args)
    prompt_ids = _ids(args.prompt_ids, "--prompt-ids") if args.prompt_ids else None
    stops = _ids(args.stop_token_ids, "--stop-token-ids") if args.stop_token_ids is not None else None
    device, dtype = _device_and_dtype(args.dtype)
    draft = load_drafter(args.drafter, device, dtype, args.liger)
    target = setup.build_target(args, device, dtype)
    tokenizer = None
    if args.prompt or args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.target)
        if args.prompt:
            prompt_ids = tokenizer(args.prompt, add_special_tokens=False)["input_ids"]
    if stops is None:
        eos = getattr(target.generation_config, "eos_token_id", None)
        stops = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    generator = torch.Generator(device=device).manual_seed(args.seed)
    input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    output = draft.spec_generate(
        target, input_ids, args.max_new_tokens, stops, args.temperature, refine=not args.plain, generator=generator
    )
    new = output.sequences[0, output.prompt_length :].tolist()
    print(tokenizer.decode(new) if tokenizer is not None else ",".join(map(str, new)))
    print(
        f"{output.new_tokens} tokens, {len(output.acceptance_lengths)} verification steps, mean acceptance length "
        f"{output.mean_acceptance_length:.3f}, {output.tokens_per_target_forward:.3f} tokens per target forward; "
        f"draft {output.draft_s:.3f} s, verify {output.verify_s:.3f} s, prefill {output.prefill_s:.3f} s",
        file=sys.stderr,
    )
    return 0


def main(args) -> int:
    """``generate`` from parsed arguments: a bad argument or input is one line on stderr and exit status 2."""
    try:
        return run(args)
    except ValueError as error:
        if not str(error).startswith(("liger-dspine:", "DSpine ")):
            raise
        print(error if str(error).startswith("liger-dspine:") else f"liger-dspine: {error}", file=sys.stderr)
        return 2
