"""``train-drafter --eval-dataset FILE --eval-every N``: the drafter's offline acceptance length while it trains.

The held-out prompts are continued greedily by the frozen target and their taps captured once, before the first step
(:func:`~liger_dspine.drafter_training.evaluation.build_eval_set`); each evaluation then runs only the drafter. Rank 0
evaluates and logs.
"""

import argparse
import logging
import os

from liger_dspine.drafter_training import data
from liger_dspine.drafter_training.evaluation import build_eval_set
from liger_dspine.drafter_training.evaluation import offline_acceptance

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("evaluation")
    group.add_argument(
        "--eval-dataset",
        help="held-out JSONL (as --dataset): log the drafter's offline acceptance length on it (eval-drafter's)",
    )
    group.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (0: after the last step only)")
    group.add_argument("--eval-new-tokens", type=int, default=32, help="continuation tokens (anchors) per prompt")
    group.add_argument("--eval-max-prompt-length", type=int, default=256, help="prompt tokens kept at most")


def check_arguments(args: argparse.Namespace) -> None:
    """A ValueError naming the first bad evaluation argument."""
    dataset = getattr(args, "eval_dataset", None)
    if dataset is not None and not os.path.isfile(dataset):
        raise ValueError(f"liger-dspine: --eval-dataset {dataset!r} is not a file")
    if getattr(args, "eval_every", 0) < 0:
        raise ValueError(f"liger-dspine: --eval-every must be >= 0, got {args.eval_every}")
    if dataset is None and getattr(args, "eval_every", 0):
        raise ValueError("liger-dspine: --eval-every needs --eval-dataset (the held-out prompts)")
    for name in ("eval_new_tokens", "eval_max_prompt_length"):
        if getattr(args, name, 1) < 1:
            raise ValueError(f"liger-dspine: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")


class AcceptanceMonitor:
    """The offline acceptance length of ``draft`` on the held-out prompts every ``every`` steps and at the last."""

    def __init__(self, target, draft, documents: list, every: int, total_steps: int, prompt_length: int, new: int):
        self.target, self.draft = target, draft
        self.every, self.total_steps = every, total_steps
        self.sequences = build_eval_set(target, documents, draft.target_layer_ids, draft.block_size, prompt_length, new)

    def due(self, step: int) -> bool:
        return step == self.total_steps or (self.every > 0 and step % self.every == 0)

    def __call__(self, step: int) -> dict[str, float]:
        """{"eval_acceptance_length": refined, "eval_acceptance_length_plain": plain}, logged."""
        results = offline_acceptance(self.draft, self.target, self.sequences)
        refined, plain = results["refined"].mean_acceptance_length, results["plain"].mean_acceptance_length
        logger.info("step %d: offline acceptance length %.3f (plain %.3f)", step, refined, plain)
        return {"eval_acceptance_length": refined, "eval_acceptance_length_plain": plain}


def acceptance_monitor(args, target, draft, mask_token_id: int) -> AcceptanceMonitor | None:
    """The monitor ``--eval-dataset`` asks for, or None."""
    if getattr(args, "eval_dataset", None) is None:
        return None
    tokenizer = data.TokenizerSource(args.tokenizer or args.target)
    vocab_size = target.get_output_embeddings().weight.shape[0]
    documents = data.read_documents(args.eval_dataset, tokenizer, vocab_size, mask_token_id)
    return AcceptanceMonitor(
        target, draft, documents, args.eval_every, args.steps, args.eval_max_prompt_length, args.eval_new_tokens
    )
