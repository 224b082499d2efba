"""How good a DSpine drafter is: its acceptance length against a frozen target.

Offline (teacher-forced): each held-out prompt is continued greedily by the target, the target's taps over prompt and
continuation are captured once, and every position of the continuation is an anchor: its block is drafted from the
taps before it in one drafter forward (many blocks at once) and compared with the continuation. A block keeps its
longest prefix of proposals equal to the continuation, as a verification by the target would, so its acceptance
length is 1 + that prefix (the target's own token counts, as in SpecForge's DFlash ``accept_len``).

End to end: :func:`~liger_dspine.models.dspine.generation.spec_generate` on the same prompts, and the acceptance length
of each of its verification steps.

Both for the refined draft (the transition scores' greedy path) and the plain one (the argmax of the drafter's
logits).
"""

from dataclasses import dataclass

import torch

from liger_dspine.models.dspine.capture import TargetCapture
from liger_dspine.models.dspine.drafting import draft_blocks
from liger_dspine.models.dspine.generation import cache_argument
from liger_dspine.models.dspine.generation import spec_generate
from liger_dspine.models.dspine.target_fit import check_drafter_fits_target

VARIANTS = ("refined", "plain")


@dataclass
class AcceptanceStats:
    """Accepted proposals per block (offline) or per verification step (end to end), for a block of ``block_size``.

    ``accepted``: [N] long in [0, block_size - 1].
    """

    accepted: torch.Tensor
    block_size: int

    @property
    def blocks(self) -> int:
        return int(self.accepted.numel())

    @property
    def mean_acceptance_length(self) -> float:
        """1 + the mean accepted proposals (the target's own token included); 0.0 without a block."""
        return 1.0 + float(self.accepted.float().mean()) if self.blocks else 0.0

    def position_rates(self) -> list[float]:
        """For block positions 1 .. P: the fraction of blocks whose accepted prefix reaches that position."""
        positions = torch.arange(1, self.block_size, device=self.accepted.device)
        if not self.blocks:
            return [0.0] * len(positions)
        return (self.accepted[:, None] >= positions).float().mean(dim=0).tolist()

    def conditional_rates(self) -> list[float]:
        """For block positions 1 .. P: the fraction accepted among the blocks whose prefix reached the position
        before (0.0 where none did)."""
        reached = [1.0] + self.position_rates()
        return [after / before if before > 0 else 0.0 for before, after in zip(reached[:-1], reached[1:])]


@dataclass
class EvalSequence:
    """A held-out prompt continued greedily by the target: ``input_ids`` [L] long (prompt, then continuation),
    ``prompt_length``, ``anchors`` (how many continuation positions anchor a full block), ``taps`` [1, L, T*H]."""

    input_ids: torch.Tensor
    prompt_length: int
    anchors: int
    taps: torch.Tensor


def prompt_of(input_ids: torch.Tensor, loss_mask: torch.Tensor, max_prompt_length: int) -> torch.Tensor:
    """A held-out document's prompt: its tokens before the first supervised one (a conversation's prompt turns), or
    the whole document when it starts supervised; at most its first ``max_prompt_length`` tokens."""
    supervised = (loss_mask > 0.5).nonzero()
    first = int(supervised[0]) if supervised.numel() else len(input_ids)
    prompt = input_ids[: first if first > 0 else len(input_ids)]
    return prompt[:max_prompt_length]


@torch.no_grad()
def greedy_continuation(target, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """[1, S + new_tokens]: the prompt [1, S] and the target's greedy tokens after it (no stop token)."""
    name = cache_argument(target)
    output = target(input_ids=prompt, use_cache=True)
    tokens = [output.logits[:, -1:].argmax(dim=-1)]
    for _ in range(new_tokens - 1):
        output = target(input_ids=tokens[-1], use_cache=True, **{name: getattr(output, name)})
        tokens.append(output.logits[:, -1:].argmax(dim=-1))
    return torch.cat([prompt, *tokens], dim=1)


@torch.no_grad()
def build_eval_set(
    target, documents: list, target_layer_ids: list[int], block_size: int, max_prompt_length: int, new_tokens: int
) -> list[EvalSequence]:
    """Each document's prompt (:func:`prompt_of`) continued greedily by ``new_tokens + block_size - 1`` tokens (so
    that each of the first ``new_tokens`` continuation positions anchors a full block), and its taps."""
    if new_tokens < 1 or max_prompt_length < 1:
        raise ValueError(
            f"liger-dspine: the evaluation needs new_tokens >= 1 and max_prompt_length >= 1, got {new_tokens} and "
            f"{max_prompt_length}"
        )
    capture = TargetCapture(target, target_layer_ids)
    device = target.get_output_embeddings().weight.device
    sequences = []
    for input_ids, loss_mask in documents:
        prompt = prompt_of(input_ids, loss_mask, max_prompt_length).to(device)[None]
        full = greedy_continuation(target, prompt, new_tokens + block_size - 1)
        taps = capture(full)["hidden_states"]
        sequences.append(EvalSequence(full[0], prompt.shape[1], new_tokens, taps))
    return sequences


@torch.no_grad()
def offline_acceptance(
    draft, target, sequences: list[EvalSequence], blocks_per_forward: int = 64
) -> dict[str, AcceptanceStats]:
    """{"refined": ..., "plain": ...}: every anchor of every sequence drafted from the taps before it and compared
    with the target's continuation; ``blocks_per_forward`` blocks per drafter forward."""
    check_drafter_fits_target(draft, target)
    embed, head_weight = target.get_input_embeddings(), target.get_output_embeddings().weight
    block_size = draft.block_size
    accepted = {variant: [] for variant in VARIANTS}
    was_training = draft.training
    draft.eval()
    try:
        for sequence in sequences:
            ids = sequence.input_ids
            first = sequence.prompt_length
            for start in range(first, first + sequence.anchors, blocks_per_forward):
                positions = torch.arange(start, min(start + blocks_per_forward, first + sequence.anchors))
                positions = positions.to(ids.device)
                drafted = draft_blocks(draft, embed, head_weight, sequence.taps, positions[None], ids[positions][None])
                reference = ids[positions[:, None] + torch.arange(1, block_size, device=ids.device)]  # [N, P]
                for variant, proposals in (("refined", drafted.refined), ("plain", drafted.plain)):
                    matches = (proposals[0] == reference).long()
                    accepted[variant].append(matches.cumprod(dim=-1).sum(dim=-1).cpu())
    finally:
        draft.train(was_training)
    return {variant: AcceptanceStats(_cat(values), block_size) for variant, values in accepted.items()}


def end_to_end_acceptance(
    draft, target, prompts: list[torch.Tensor], max_new_tokens: int, stop_token_ids: list[int] | None = None
) -> dict[str, AcceptanceStats]:
    """{"refined": ..., "plain": ...}: the accepted proposals of every verification step of greedy
    :func:`spec_generate` over ``prompts`` (each [S] long)."""
    results = {}
    for variant in VARIANTS:
        steps = []
        for prompt in prompts:
            output = spec_generate(
                draft, target, prompt[None], max_new_tokens, stop_token_ids, refine=variant == "refined"
            )
            steps += [length - 1 for length in output.acceptance_lengths]
        results[variant] = AcceptanceStats(torch.tensor(steps, dtype=torch.long), draft.block_size)
    return results


def _cat(values: list) -> torch.Tensor:
    return torch.cat(values) if values else torch.zeros(0, dtype=torch.long)
