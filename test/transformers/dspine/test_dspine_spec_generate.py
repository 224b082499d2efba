"""``DSpineDraftModel.spec_generate``: lossless speculative decoding against ``target.generate``.

Greedy: the output equals ``generate(do_sample=False)`` token for token, over prompts of several lengths, budgets and
stop tokens, with a trained drafter (some proposals accepted) and an untrained one (almost none), refined and plain,
for Qwen3 and DeepSeek-V3 targets, native and patched. An oracle drafter that proposes the target's own continuation
with known wrong slots pins the acceptance lengths and the cache bookkeeping. Sampled: the acceptance rule emits the
target's distribution (checked by counting), and a near-zero temperature gives the greedy output.
"""

import pytest
import torch

from liger_dspine.models.dspine import generation
from liger_dspine.models.dspine.verification import sampled_acceptance
from tiny_acceptance import one_thread
from tiny_acceptance import trained_drafter
from tiny_dspine import TINY_MASK_TOKEN
from tiny_dspine import TINY_VOCAB
from tiny_dspine import seeded_draft
from tiny_dspine import tiny_draft_config
from tiny_dspine import tiny_target


@pytest.fixture(autouse=True)
def single_thread():
    with one_thread():
        yield


def prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, TINY_MASK_TOKEN, (1, length), generator=torch.Generator().manual_seed(seed))


def reference(target, input_ids, max_new_tokens, stop_token_ids=None):
    return target.generate(
        input_ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stop_token_ids, pad_token_id=0
    )


@pytest.mark.parametrize("refine", [True, False], ids=["refined", "plain"])
def test_trained_drafter_output_equals_greedy_generate(refine):
    target, draft = trained_drafter()[:2]
    accepted = 0
    cases = [(1, 17), (2, 24), (5, 30), (9, 12), (4, 1), (12, 2), (3, 25), (7, 40), (16, 9), (2, 33), (6, 3)]
    cases += [(length, 20) for length in range(1, 12, 2)]
    for seed, (length, budget) in enumerate(cases):
        input_ids = prompt(length, seed)
        expected = reference(target, input_ids, budget)
        output = draft.spec_generate(target, input_ids, budget, refine=refine)
        assert torch.equal(output.sequences, expected), (length, budget)
        assert output.new_tokens == budget and output.target_forwards == 1 + len(output.acceptance_lengths)
        assert sum(output.acceptance_lengths) >= budget - 1  # the prefill gave the first token
        accepted += sum(length - 1 for length in output.acceptance_lengths)
    assert accepted > 10  # proposals were accepted: the accepted branches ran


@pytest.mark.parametrize("refine", [True, False], ids=["refined", "plain"])
def test_stop_tokens_end_generation_as_generate_does(refine):
    target, draft = trained_drafter()[:2]
    for seed in range(4):
        input_ids = prompt(3 + seed, 100 + seed)
        free = reference(target, input_ids, 30)[0, input_ids.shape[1] :].tolist()
        for stops in ([free[0]], [free[7], free[12]], [free[20]], [TINY_MASK_TOKEN - 1, free[3]]):
            expected = reference(target, input_ids, 30, stops)
            output = draft.spec_generate(target, input_ids, 30, stop_token_ids=stops, refine=refine)
            assert torch.equal(output.sequences, expected), (seed, stops)
            assert output.sequences[0, -1] in stops


def test_untrained_drafter_output_equals_greedy_generate():
    target = tiny_target(seed=4)
    draft = seeded_draft(target, tiny_draft_config(), seed=1)
    for seed, length in enumerate([1, 6, 11]):
        input_ids = prompt(length, 200 + seed)
        output = draft.spec_generate(target, input_ids, 16)
        assert torch.equal(output.sequences, reference(target, input_ids, 16))
        assert output.draft_s > 0 and output.verify_s > 0 and output.prefill_s > 0


def oracle_drafts(continuation: list[int], wrong: set[int], block_size: int):
    """A drafter proposing the target's greedy continuation (by absolute position), wrong at positions ``wrong``."""

    def draft(draft_model, target, taps, anchor_position, anchor_id, temperature, refine, generator):
        assert taps.shape[1] == anchor_position  # the taps of every position before the anchor, none after
        positions = range(anchor_position + 1, anchor_position + block_size)
        tokens = [(continuation[p] + 1) % TINY_MASK_TOKEN if p in wrong else continuation[p] for p in positions]
        return torch.tensor(tokens), None

    return draft


def test_oracle_drafter_pins_acceptance_lengths_and_cache_crops(monkeypatch):
    target = tiny_target()
    draft = seeded_draft(target, tiny_draft_config(), seed=1)
    input_ids = prompt(5, 7)
    budget, block = 26, draft.block_size
    expected = reference(target, input_ids, budget + block)
    continuation = expected[0].tolist()
    wrong = {8, 9, 15, 16, 17, 25}
    monkeypatch.setattr(generation, "_draft", oracle_drafts(continuation, wrong, block))
    output = draft.spec_generate(target, input_ids, budget)
    assert torch.equal(output.sequences, expected[:, : 5 + budget])
    # replay the bookkeeping: the first token came from the prefill, at position 5
    anchor, lengths = 5, []
    while anchor < 5 + budget - 1:
        proposals = range(anchor + 1, anchor + block)
        accepted = next((i for i, p in enumerate(proposals) if p in wrong), block - 1)
        lengths.append(accepted + 1)
        anchor += accepted + 1
    assert output.acceptance_lengths == lengths
    assert output.mean_acceptance_length == pytest.approx(sum(lengths) / len(lengths))
    assert output.tokens_per_target_forward == pytest.approx(budget / (1 + len(lengths)))


def test_deepseek_v3_target_native_and_patched():
    from liger_dspine import apply_liger_kernel_to_deepseek_v3
    from tiny_models import build_model
    from tiny_models import tiny_deepseek_v3_config

    target = build_model(tiny_deepseek_v3_config()).eval().requires_grad_(False)
    config = tiny_draft_config(dflash_config={"mask_token_id": TINY_MASK_TOKEN, "target_layer_ids": [0, 1]})
    draft = seeded_draft(target, config, seed=2)
    input_ids = prompt(6, 11)
    native = draft.spec_generate(target, input_ids, 10)
    assert torch.equal(native.sequences, reference(target, input_ids, 10))
    apply_liger_kernel_to_deepseek_v3(model=target)
    patched = draft.spec_generate(target, input_ids, 6)
    assert torch.equal(patched.sequences, reference(target, input_ids, 6))


def test_a_cache_that_cannot_be_cropped_is_refused():
    from tiny_family import CASES

    target = CASES["deepseek_v4"].build().eval().requires_grad_(False)
    config = target.config
    draft_config = tiny_draft_config(
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        dflash_config={"mask_token_id": config.vocab_size - 1, "target_layer_ids": [0]},
    )
    draft = seeded_draft(target, draft_config, seed=0)
    with pytest.raises(
        ValueError, match=r"^liger-dspine: spec_generate needs a KV cache it can crop.*DynamicCache cannot be cropped"
    ):
        draft.spec_generate(target, prompt(4, 0) % (config.vocab_size - 1), 4)


def test_sampled_acceptance_emits_the_target_distribution():
    """Exact counting over 20000 draws of one proposal: P(first token = x) = p(x) for any draft q (4-sigma bound)."""
    generator = torch.Generator().manual_seed(0)
    p_logits = torch.tensor([[2.0, 0.5, -1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 3.0]])
    q = torch.tensor([0.05, 0.6, 0.3, 0.05, 0.0])
    p = torch.softmax(p_logits[0], dim=-1)
    draws, counts = 20000, torch.zeros(5)
    for _ in range(draws):
        proposal = torch.multinomial(q, 1, generator=generator)
        accepted, token = sampled_acceptance(proposal, q[None], p_logits, 1.0, generator)
        counts[int(proposal) if accepted else token] += 1
    sigma = (p * (1 - p) / draws).sqrt()
    assert ((counts / draws - p).abs() <= 4 * sigma).all(), (counts / draws, p)


@pytest.mark.parametrize("refine", [True, False], ids=["refined", "plain"])
def test_near_zero_temperature_samples_the_greedy_output(refine):
    target, draft = trained_drafter()[:2]
    for seed in range(3):
        input_ids = prompt(4 + seed, 300 + seed)
        generator = torch.Generator().manual_seed(seed)
        output = draft.spec_generate(target, input_ids, 20, temperature=1e-4, refine=refine, generator=generator)
        assert torch.equal(output.sequences, reference(target, input_ids, 20))


def test_sampling_is_reproducible_with_a_seeded_generator():
    target, draft = trained_drafter()[:2]
    input_ids = prompt(5, 400)
    runs = [
        draft.spec_generate(target, input_ids, 20, temperature=1.0, generator=torch.Generator().manual_seed(1))
        for _ in range(2)
    ]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert runs[0].acceptance_lengths == runs[1].acceptance_lengths


@pytest.fixture(scope="module")
def tiny_pair():
    target = tiny_target()
    return target, seeded_draft(target, tiny_draft_config(), seed=1)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"input_ids": torch.zeros(2, 4, dtype=torch.long)}, "batch 1.*got a batch of 2"),
        ({"input_ids": torch.zeros(1, 0, dtype=torch.long)}, "prompt of at least 1 token"),
        ({"input_ids": torch.full((1, 3), TINY_VOCAB)}, r"input_ids must be token ids in \[0, 96\)"),
        ({"max_new_tokens": 0}, "max_new_tokens must be an int >= 1, got 0"),
        ({"stop_token_ids": [3, TINY_VOCAB]}, r"stop_token_ids must be token ids in \[0, 96\).*got 96"),
        ({"stop_token_ids": [-1]}, r"stop_token_ids must be token ids .*got -1"),
        ({"temperature": -0.5}, "temperature must be a finite number >= 0, got -0.5"),
    ],
)
def test_bad_arguments_are_named(tiny_pair, kwargs, message):
    target, draft = tiny_pair
    arguments = {"input_ids": prompt(3, 0), "max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=f"^liger-dspine: .*{message}"):
        draft.spec_generate(target, **arguments)


def test_a_drafter_that_does_not_fit_the_target_is_named(tiny_pair):
    target, _ = tiny_pair
    fresh = seeded_draft(target, tiny_draft_config(), seed=1)
    fresh.transfer_ready.fill_(False)
    with pytest.raises(ValueError, match="^liger-dspine: the drafter has no transfer space"):
        fresh.spec_generate(target, prompt(3, 0), 4)
    wide = tiny_target()  # same width, but a drafter built for a larger vocabulary
    other = seeded_draft(tiny_target_with_vocab(128), tiny_draft_config(vocab_size=128), seed=1)
    with pytest.raises(ValueError, match=r"^liger-dspine: the target's lm_head is \[96, 32\].*vocabulary 128"):
        other.spec_generate(wide, prompt(3, 0), 4)
    taps = seeded_draft(target, tiny_draft_config(dflash_config={"mask_token_id": 95, "target_layer_ids": [0, 7]}), 1)
    with pytest.raises(ValueError, match=r"^liger-dspine: the drafter taps target layers \[0, 7\].*4 layers"):
        taps.spec_generate(target, prompt(3, 0), 4)


def tiny_target_with_vocab(vocab_size: int):
    from transformers import Qwen3Config
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=vocab_size,
    )  # fmt: skip
    return Qwen3ForCausalLM(config).eval()
