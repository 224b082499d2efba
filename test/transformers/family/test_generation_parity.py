"""``generate()`` of a patched model against the native model, in the modes of transformers'
``GenerationTesterMixin``: greedy with scores and logits, a left-padded batch, beam search, seeded sampling, the
static cache, continuing from a returned cache, assisted decoding, hidden states and attention weights; one
class-level case. One tiny model per type (tiny_family.py), fp32, eval mode, patched at instance level on a copy."""

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from liger_dspine import apply_liger_kernel_to_deepseek_v3  # noqa: E402
from liger_dspine.modules.rms_norm import LigerRMSNorm  # noqa: E402
from tiny_family import CASES  # noqa: E402
from tiny_family import COMMON  # noqa: E402
from tiny_family import MLA  # noqa: E402
from tiny_family import MOE  # noqa: E402
from tiny_family import FamilyCase  # noqa: E402
from tiny_models import class_patches_reverted  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

# DeepSeek-V3 itself is not in CASES (its own tests build it from tiny_models.py): the same widths as the family's
# tiny models, a dense layer then a MoE layer.
DEEPSEEK_V3 = FamilyCase(
    "deepseek_v3",
    "DeepseekV3",
    {**COMMON, **MLA, **MOE, "first_k_dense_replace": 1},
    (),
)
MODEL_TYPES = ("deepseek_v3", "deepseek_v2", "glm4_moe_lite", "deepseek_v4")
NEW_TOKENS = 3  # every step of the patched model runs its kernels through Triton's interpreter (~500x eager)
# Weights 5x the default init (0.02): the attention no longer averages its keys almost uniformly, so a wrong position
# or mask moves the logits by about 0.1 of their scale (2e-3 at 0.02), and greedy picks are not near-ties.
INIT = 0.1
# fp32 on both sides: the kernels sum in another order (norms, SwiGLU, grouped experts, the attention's softmax and
# PV); the patched logits and hidden states measured within 6e-7 of the tensor's scale here. 1e-5 of the scale leaves
# that margin, and a wrong position, mask or routing is orders of magnitude above it.
RTOL = 1e-5


def case_of(model_type: str) -> FamilyCase:
    return DEEPSEEK_V3 if model_type == "deepseek_v3" else CASES[model_type]


@pytest.fixture(scope="module", params=MODEL_TYPES)
def models(request):
    """The case, the native model and an instance-patched copy, both fp32 in eval mode."""
    case = case_of(request.param)
    case.modeling_or_skip()
    # DeepSeek-V4's case records router logits (for its auxiliary loss in training); with them on, transformers 5.25's
    # native forward fails in a decoding step given an attention mask: load_balancing_loss_func weighs the new
    # tokens' router logits by the mask of past and new tokens (shapes 2 and 12 here). Generation never reads them.
    overrides = {"output_router_logits": False} if "output_router_logits" in case.config_values else {}
    native = case.build(initializer_range=INIT, **overrides).eval()
    patched = copy.deepcopy(native)
    case.apply_fn()(model=patched)
    assert type(patched).forward is type(native).forward  # an instance patch: the class stays native
    assert any(type(m).__module__.startswith("liger_dspine.") for m in patched.modules())
    return case, native, patched


def prompt(case, batch: int = 1, length: int = 5, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, case.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def assert_close(actual, expected, what: str) -> None:
    """Close within RTOL of the tensor's own scale: entries near zero differ by rounding of the large ones."""
    assert isinstance(actual, torch.Tensor), f"{what}: {type(actual).__name__} where native gives a tensor"
    atol = RTOL * expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=atol, msg=lambda m: f"{what}: {m}")


def assert_steps_close(actual, expected, what: str) -> None:
    """Per-step tensors (scores, logits) of a generate output."""
    assert len(actual) == len(expected), what
    for step, (a, e) in enumerate(zip(actual, expected)):
        assert_close(a, e, f"{what} step {step}")


def assert_layers_close(actual, expected, what: str) -> None:
    """Per-step, per-layer tensors (hidden states, attention weights) of a generate output."""
    for step, (layers, native_layers) in enumerate(zip(actual, expected)):
        assert len(layers) == len(native_layers)
        for layer, (a, e) in enumerate(zip(layers, native_layers)):
            assert_close(a, e, f"{what} step {step} layer {layer}")


def generate_both(native, patched, *args, seed=None, **kwargs):
    """The same generate() call on each model (``seed``: torch.manual_seed before each)."""
    outputs = []
    for model in (native, patched):
        if seed is not None:
            torch.manual_seed(seed)
        outputs.append(model.generate(*args, **kwargs))
    return outputs


def test_greedy_scores_and_logits(models):
    case, native, patched = models
    expected, actual = generate_both(
        native,
        patched,
        prompt(case),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
    )
    assert expected.sequences.shape == (1, 5 + NEW_TOKENS)
    assert torch.equal(actual.sequences, expected.sequences)
    assert_steps_close(actual.scores, expected.scores, "scores")
    assert_steps_close(actual.logits, expected.logits, "logits")


def test_left_padded_batch_with_attention_mask(models):
    """Prompts of 5 and 3 tokens, the shorter one left-padded: the logits of both rows as native's, so the mask and
    the positions reach the patched attention as they reach the native one."""
    case, native, patched = models
    input_ids = prompt(case, batch=2)
    attention_mask = torch.ones_like(input_ids)
    input_ids[1, :2] = 0
    attention_mask[1, :2] = 0
    expected, actual = generate_both(
        native,
        patched,
        input_ids,
        attention_mask=attention_mask,
        pad_token_id=0,
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
    )
    assert torch.equal(actual.sequences, expected.sequences)
    assert_steps_close(actual.logits, expected.logits, "logits")


def test_beam_search(models):
    case, native, patched = models
    expected, actual = generate_both(
        native,
        patched,
        prompt(case),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        num_beams=2,
        num_return_sequences=2,
        return_dict_in_generate=True,
        output_scores=True,
    )
    assert expected.sequences.shape == (2, 5 + NEW_TOKENS)
    assert torch.equal(actual.sequences, expected.sequences)
    assert_close(actual.sequences_scores, expected.sequences_scores, "sequences_scores")


def test_sampling_with_a_fixed_seed(models):
    case, native, patched = models
    expected, actual = generate_both(
        native,
        patched,
        prompt(case),
        seed=11,
        max_new_tokens=NEW_TOKENS,
        do_sample=True,
        top_k=8,
        temperature=0.7,
    )
    assert torch.equal(actual, expected)


def test_static_cache(models):
    case, native, patched = models
    input_ids = prompt(case)
    kwargs = dict(
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        cache_implementation="static",
        return_dict_in_generate=True,
        output_logits=True,
    )
    try:
        expected = native.generate(input_ids, **kwargs)
    except Exception as error:  # noqa: BLE001  (whatever the native model raises for it)
        pytest.skip(f"the native {case.model_type} refuses the static cache: {type(error).__name__}: {error}")
    actual = patched.generate(input_ids, **kwargs)
    assert torch.equal(actual.sequences, expected.sequences)
    assert_steps_close(actual.logits, expected.logits, "logits")


def test_continue_from_the_returned_cache(models):
    """2 tokens, then 2 more from the first call's cache (``cache=``, formerly ``past_key_values``; the second call's
    prefill runs over a past): as native, and as native's 4 tokens in one call."""
    case, native, patched = models
    input_ids = prompt(case)
    kwargs = dict(do_sample=False, return_dict_in_generate=True, output_logits=True)
    first = generate_both(native, patched, input_ids, max_new_tokens=2, **kwargs)
    expected, actual = (
        model.generate(out.sequences, cache=out.cache, max_new_tokens=2, **kwargs)
        for model, out in zip((native, patched), first)
    )
    whole = native.generate(input_ids, max_new_tokens=4, **kwargs)
    assert torch.equal(expected.sequences, whole.sequences)  # the mode itself holds natively
    assert torch.equal(actual.sequences, expected.sequences)
    assert_steps_close(actual.logits, expected.logits, "logits")


def test_prompt_lookup_assisted_decoding_gives_native_greedy(models):
    """Candidates from the prompt's n-grams, checked by one forward over several new tokens with a past."""
    case, native, patched = models
    input_ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7]])
    reference = native.generate(input_ids, max_new_tokens=4, do_sample=False)
    try:
        assisted = native.generate(input_ids, max_new_tokens=4, do_sample=False, prompt_lookup_num_tokens=2)
    except Exception as error:  # noqa: BLE001
        pytest.skip(f"the native {case.model_type} refuses assisted decoding: {type(error).__name__}: {error}")
    assert torch.equal(assisted, reference)
    actual = patched.generate(input_ids, max_new_tokens=4, do_sample=False, prompt_lookup_num_tokens=2)
    assert torch.equal(actual, reference)


def test_hidden_states(models):
    case, native, patched = models
    expected, actual = generate_both(
        native,
        patched,
        prompt(case),
        max_new_tokens=2,
        do_sample=False,
        return_dict_in_generate=True,
        output_hidden_states=True,
    )
    assert torch.equal(actual.sequences, expected.sequences)
    assert len(actual.hidden_states) == len(expected.hidden_states) == 2
    assert_layers_close(actual.hidden_states, expected.hidden_states, "hidden state")


def test_attention_weights(models):
    """Asked for attention weights, the patched model returns them, as native does, with native's values."""
    case, native, patched = models
    expected, actual = generate_both(
        native,
        patched,
        prompt(case),
        max_new_tokens=2,
        do_sample=False,
        return_dict_in_generate=True,
        output_attentions=True,
    )
    assert torch.equal(actual.sequences, expected.sequences)
    assert expected.attentions is not None and len(expected.attentions) == 2
    assert actual.attentions is not None, "the patched model returns no attentions"
    assert len(actual.attentions) == len(expected.attentions)
    for native_layers in expected.attentions:
        assert len(native_layers) == case.config().num_hidden_layers
        assert all(isinstance(e, torch.Tensor) for e in native_layers)
    assert_layers_close(actual.attentions, expected.attentions, "attention weights")


def test_class_level_patch_greedy_as_native():
    """DeepSeek-V3 patched at class level, built after the patch: greedy logits as native's; every global of the
    modeling module back afterwards."""
    case = DEEPSEEK_V3
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True, output_logits=True)
    native = case.build(initializer_range=INIT).eval()
    expected = native.generate(prompt(case), **kwargs)  # before the patch: it replaces the class's forward too
    with class_patches_reverted():
        apply_liger_kernel_to_deepseek_v3()
        patched = case.build(initializer_range=INIT).eval()
        patched.load_state_dict(native.state_dict())
        assert type(patched.model.norm) is LigerRMSNorm
        actual = patched.generate(prompt(case), **kwargs)
    assert torch.equal(actual.sequences, expected.sequences)
    assert_steps_close(actual.logits, expected.logits, "logits")
