"""Speculative decoding with a DSpine drafter and a transformers target with its KV cache.

Each step drafts one block from the target's taps (:mod:`~liger_dspine.models.dspine.drafting`), verifies it with one
target forward over [anchor, proposals] (:mod:`~liger_dspine.models.dspine.verification`), keeps the accepted prefix
and the target's own next token, and crops the target's cache back to what was kept. The next token is the next
block's anchor. As SpecForge's DFlash loop and transformers' assisted generation count it, a step's acceptance length
is its accepted proposals plus the target's token.
"""

import inspect
import time
from dataclasses import dataclass
from dataclasses import field

import torch

from liger_dspine.models.dspine.drafting import draft_blocks
from liger_dspine.models.dspine.drafting import drafter_logits
from liger_dspine.models.dspine.drafting import proposal_states
from liger_dspine.models.dspine.drafting import refined_candidates
from liger_dspine.models.dspine.taps import TapRecorder
from liger_dspine.models.dspine.target_fit import check_drafter_fits_target
from liger_dspine.models.dspine.verification import greedy_acceptance
from liger_dspine.models.dspine.verification import sample_plain_drafts
from liger_dspine.models.dspine.verification import sample_refined_drafts
from liger_dspine.models.dspine.verification import sampled_acceptance
from liger_dspine.models.dspine.verification import tempered_probs


@dataclass
class SpecGenerateOutput:
    """sequences: [1, prompt + new tokens] long, the prompt then the generated tokens (up to ``max_new_tokens``, and
    up to and including the first stop token).

    acceptance_lengths: per verification step, accepted proposals + 1 (the target's own token); steps past the
    budget or a stop token still count what they accepted.
    target_forwards: the prefill and every verification forward.
    draft_s / verify_s / prefill_s: wall time of the drafter, of the verification forwards and of the prefill.
    """

    sequences: torch.Tensor
    prompt_length: int
    acceptance_lengths: list[int] = field(default_factory=list)
    target_forwards: int = 1
    draft_s: float = 0.0
    verify_s: float = 0.0
    prefill_s: float = 0.0

    @property
    def new_tokens(self) -> int:
        return self.sequences.shape[1] - self.prompt_length

    @property
    def mean_acceptance_length(self) -> float:
        """Mean tokens a verification step produced (0.0 without a step)."""
        steps = self.acceptance_lengths
        return sum(steps) / len(steps) if steps else 0.0

    @property
    def tokens_per_target_forward(self) -> float:
        """Generated tokens over target forwards, the prefill included."""
        return self.new_tokens / self.target_forwards


def _check_inputs(input_ids, max_new_tokens, stop_token_ids, temperature, vocab_size) -> list[int]:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"liger-dspine: spec_generate needs input_ids [1, S] of token ids, got {shape}")
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"liger-dspine: spec_generate decodes one sequence at a time (batch 1), got a batch of "
            f"{input_ids.shape[0]}: call it once per prompt"
        )
    if input_ids.shape[1] < 1:
        raise ValueError("liger-dspine: spec_generate needs a prompt of at least 1 token (the first block's context)")
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(
            f"liger-dspine: input_ids must be token ids in [0, {vocab_size}), got ids from {low} to {high}"
        )
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"liger-dspine: max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    stops = [] if stop_token_ids is None else list(stop_token_ids)
    for stop in stops:
        if isinstance(stop, bool) or not isinstance(stop, int) or not 0 <= stop < vocab_size:
            raise ValueError(
                f"liger-dspine: stop_token_ids must be token ids in [0, {vocab_size}) (the target's vocabulary), got "
                f"{stop!r}"
            )
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not 0 <= temperature < float("inf")
    ):
        raise ValueError(f"liger-dspine: temperature must be a finite number >= 0, got {temperature!r}")
    return stops


class _Timer:
    def __init__(self, device: torch.device):
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def __enter__(self):
        self.sync()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.sync()
        self.seconds = time.perf_counter() - self.start


def cache_argument(target) -> str:
    """The name of the forward's cache argument and output field: ``cache`` (newer transformers) or
    ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"


def _first_token(logits: torch.Tensor, temperature: float, generator) -> int:
    if temperature == 0:
        return int(logits.argmax())
    return int(torch.multinomial(tempered_probs(logits, temperature), 1, generator=generator))


def _draft(draft, target, taps, anchor_position, anchor_id, temperature, refine, generator):
    """Proposals [P] long of one block, and their draft distributions [P, V] when sampling."""
    embed, head_weight = target.get_input_embeddings(), target.get_output_embeddings().weight
    device = taps.device
    positions = torch.tensor([[anchor_position]], device=device)
    anchors = torch.tensor([[anchor_id]], device=device)
    if temperature == 0:
        drafted = draft_blocks(draft, embed, head_weight, taps, positions, anchors, refine=refine)
        return (drafted.refined if refine else drafted.plain)[0, 0], None
    states = proposal_states(draft, embed, taps, positions, anchors)
    logits = drafter_logits(states, head_weight)
    if not refine:
        return sample_plain_drafts(logits[0, 0], temperature, generator)
    candidates, scores = refined_candidates(draft, states, logits, anchors, head_weight)
    return sample_refined_drafts(scores[0, 0], candidates[0, 0], logits.shape[-1], temperature, generator)


def _cut(tokens: list[int], stops: list[int], budget: int) -> tuple[list[int], bool]:
    """The tokens up to the budget and the first stop token (included); whether generation ends here."""
    for index, token in enumerate(tokens[:budget]):
        if token in stops:
            return tokens[: index + 1], True
    return tokens[:budget], len(tokens) >= budget


@torch.no_grad()
def spec_generate(
    draft,
    target,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    stop_token_ids: list[int] | None = None,
    temperature: float = 0.0,
    refine: bool = True,
    generator: torch.Generator | None = None,
) -> SpecGenerateOutput:
    """Lossless speculative decoding of one prompt.

    Args:
        draft: a :class:`DSpineDraftModel` with its transfer space, on the target's device.
        target: a transformers causal LM whose cache can be cropped (patched by this package or not).
        input_ids: [1, S] long, S >= 1. A batch of several prompts is refused.
        max_new_tokens: tokens to generate at most.
        stop_token_ids: generation ends after the first of these (kept in the output); None: no stop token (as in
            SpecForge's DFlash loop; pass the target's ``eos_token_id`` to stop there, as ``generate`` does).
        temperature: 0 decodes greedily (the output is ``target.generate(do_sample=False)``'s); T > 0 samples as
            ``generate(do_sample=True, temperature=T, top_k=0, top_p=1.0)`` would, by speculative sampling.
        refine: draft the refined path (True) or the plain argmax / plain samples of the drafter's logits.
        generator: the random generator of the sampled path (on the target's device).

    Returns:
        :class:`SpecGenerateOutput`: the tokens and the statistics.
    """
    vocab_size = draft.config.vocab_size
    stops = _check_inputs(input_ids, max_new_tokens, stop_token_ids, temperature, vocab_size)
    decoder = check_drafter_fits_target(draft, target)
    device = target.get_output_embeddings().weight.device
    input_ids = input_ids.to(device)
    was_training = draft.training
    draft.eval()
    output = SpecGenerateOutput(sequences=input_ids, prompt_length=input_ids.shape[1])
    try:
        with TapRecorder(decoder, draft.target_layer_ids) as recorder:
            generated = _decode(
                draft, target, recorder, input_ids, max_new_tokens, stops, temperature, refine, generator, output
            )
    finally:
        draft.train(was_training)
    new = torch.tensor([generated], dtype=input_ids.dtype, device=device)
    output.sequences = torch.cat([input_ids, new], dim=1)
    return output


def _decode(draft, target, recorder, input_ids, max_new_tokens, stops, temperature, refine, generator, output):
    """The prefill and the draft-verify steps; fills ``output``'s statistics, returns the generated tokens."""
    device = input_ids.device
    cache_name = cache_argument(target)
    last_only = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(target.forward).parameters else {}
    with _Timer(device) as timer:
        prefill = target(input_ids=input_ids, use_cache=True, **last_only)
    output.prefill_s = timer.seconds
    cache = getattr(prefill, cache_name, None)
    if cache is None or not getattr(cache, "is_croppable", True):
        raise ValueError(
            f"liger-dspine: spec_generate needs a KV cache it can crop after a verification, and this "
            f"{type(target).__name__}'s {type(cache).__name__} cannot be cropped (is_croppable is False)"
        )
    taps = recorder.taps()  # [1, S, T*H]
    generated, done = _cut([_first_token(prefill.logits[0, -1], temperature, generator)], stops, max_new_tokens)
    sequence_length = input_ids.shape[1] + 1  # the last token is the next block's anchor, not yet in the cache
    while not done:
        anchor_position = sequence_length - 1
        anchor_id = generated[-1]
        with _Timer(device) as timer:
            proposals, draft_probs = _draft(
                draft, target, taps, anchor_position, anchor_id, temperature, refine, generator
            )
        output.draft_s += timer.seconds
        block = torch.cat([torch.tensor([anchor_id], device=device), proposals]).to(input_ids.dtype)[None]
        with _Timer(device) as timer:
            verified = target(input_ids=block, use_cache=True, **{cache_name: cache})
        output.verify_s += timer.seconds
        output.target_forwards += 1
        logits = verified.logits[0].float()  # [b, V]
        if temperature == 0:
            accepted, next_token = greedy_acceptance(proposals, logits)
        else:
            accepted, next_token = sampled_acceptance(proposals, draft_probs, logits, temperature, generator)
        output.acceptance_lengths.append(accepted + 1)
        kept = accepted + 1  # the anchor and the accepted proposals now lie in the cache
        taps = torch.cat([taps, recorder.taps()[:, :kept]], dim=1)
        removed = block.shape[1] - kept
        if removed:  # a negative count removes that many positions, in every supported transformers
            cache.crop(-removed)
        if cache.get_seq_length() != sequence_length + accepted:
            raise RuntimeError(
                f"liger-dspine: the target's cache holds {cache.get_seq_length()} positions after cropping, "
                f"{sequence_length + accepted} expected"
            )
        new_tokens, done = _cut(proposals[:accepted].tolist() + [next_token], stops, max_new_tokens - len(generated))
        generated += new_tokens
        sequence_length += accepted + 1
    return generated
