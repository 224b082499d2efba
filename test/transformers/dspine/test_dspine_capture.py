"""Target capture: the taps and final states against output_hidden_states, what is kept, packing, loss masks."""

import pytest
import torch

from liger_dspine.models.dspine import DSpineDraftModel
from liger_dspine.models.dspine import DSpineObjective
from liger_dspine.models.dspine.capture import TargetCapture
from liger_dspine.models.dspine.capture import find_decoder
from liger_dspine.models.dspine.packing import assistant_loss_mask
from liger_dspine.models.dspine.packing import chat_loss_mask
from liger_dspine.models.dspine.packing import document_ids_from_position_ids
from liger_dspine.models.dspine.packing import pack_documents
from tiny_dspine import TINY_MASK_TOKEN
from tiny_dspine import target_batch
from tiny_dspine import tiny_draft_config
from tiny_dspine import tiny_target
from tiny_models import tiny_deepseek_v3_config


def deepseek_v3_target(patched: bool):
    from transformers import DeepseekV3ForCausalLM

    from liger_dspine import apply_liger_kernel_to_deepseek_v3

    torch.manual_seed(0)
    target = DeepseekV3ForCausalLM(tiny_deepseek_v3_config(num_hidden_layers=3)).eval()
    if patched:
        apply_liger_kernel_to_deepseek_v3(model=target)
        assert type(target.model.norm).__name__.startswith("Liger")
    return target


def reference(target, input_ids, taps, **kwargs):
    """Taps and final states the long way: every layer through output_hidden_states."""
    with torch.no_grad():
        out = target.model(input_ids, output_hidden_states=True, **kwargs)
    return torch.cat([out.hidden_states[i + 1] for i in taps], dim=-1), out.last_hidden_state


@pytest.mark.parametrize(
    "name, taps, kept",
    [
        ("qwen3", [0, 2], 3),
        ("qwen3", [2, 0, 3], 3),  # any order; the last layer's tap is the final-normed state, as in HF
        ("deepseek_v3", [0, 1], 3),
        ("deepseek_v3_patched", [1, 2], 2),
    ],
)
def test_capture_equals_output_hidden_states(name, taps, kept):
    target = tiny_target() if name == "qwen3" else deepseek_v3_target(patched=name.endswith("patched"))
    input_ids = torch.randint(0, 90, (2, 9), generator=torch.Generator().manual_seed(1))
    capture = TargetCapture(target, taps)
    batch = capture(input_ids)
    assert not any(module._forward_hooks for module in target.modules())  # every hook removed
    expected_taps, expected_last = reference(target, input_ids, taps)
    hidden = target.config.hidden_size
    assert batch["hidden_states"].shape == (2, 9, len(taps) * hidden)
    assert torch.equal(batch["hidden_states"], expected_taps)
    assert torch.equal(batch["target_last_hidden_states"], expected_last)
    assert torch.equal(batch["loss_mask"], torch.ones(2, 9))
    assert capture.kept == kept  # distinct non-final taps plus the final norm: never every layer
    assert not batch["hidden_states"].requires_grad


@pytest.mark.parametrize("taps", [[], [4], [-1], [True]])
def test_capture_refuses_bad_taps(taps):
    with pytest.raises(ValueError, match=r"^liger-dspine: target_layer_ids"):
        TargetCapture(tiny_target(), taps)


def test_capture_refuses_mismatched_shapes():
    capture = TargetCapture(tiny_target(), [0])
    with pytest.raises(ValueError, match=r"^liger-dspine: loss_mask must have the shape"):
        capture(torch.zeros(2, 5, dtype=torch.long), loss_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"^liger-dspine: cannot find the decoder"):
        TargetCapture(torch.nn.Linear(2, 2), [0])


def test_find_decoder_of_every_family_model():
    from tiny_family import CASES

    found = 0
    for case in CASES.values():
        try:
            modeling = case.modeling_or_skip()
        except pytest.skip.Exception:
            continue
        with torch.device("meta"):
            model = getattr(modeling, case.causal_lm_name)(case.config())
        assert find_decoder(model) is case.decoder_of(model), case.model_type
        found += 1
    assert found >= 5


# ---------------------------------------------------------------------------------------------------- packing
def test_packed_row_captures_each_document_as_alone():
    target = tiny_target()
    generator = torch.Generator().manual_seed(3)
    first, second = torch.randint(0, 90, (5,), generator=generator), torch.randint(0, 90, (7,), generator=generator)
    row = pack_documents([(first, torch.ones(5)), (second, torch.zeros(2).tolist() + [1.0] * 5)])
    assert row.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]]
    batch = TargetCapture(target, [0, 2])(row.input_ids, loss_mask=row.loss_mask, position_ids=row.position_ids)
    assert batch["document_ids"].tolist() == [[0] * 5 + [1] * 7]
    assert batch["loss_mask"].tolist() == [[1.0] * 5 + [0.0, 0.0] + [1.0] * 5]
    for document, span in ((first, slice(0, 5)), (second, slice(5, 12))):
        alone_taps, alone_last = reference(target, document[None], [0, 2])
        torch.testing.assert_close(batch["hidden_states"][:, span], alone_taps, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(batch["target_last_hidden_states"][:, span], alone_last, rtol=1e-5, atol=1e-5)


def test_document_ids_from_position_ids():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0], [5, 6, 7, 8, 9, 10]])
    assert document_ids_from_position_ids(positions).tolist() == [[0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 0, 0]]


# ---------------------------------------------------------------------------------------------------- loss masks
def test_assistant_loss_mask_from_spans():
    assert assistant_loss_mask(8, [(1, 3), (5, 8)]).tolist() == [0, 1, 1, 0, 0, 1, 1, 1]
    with pytest.raises(ValueError, match=r"^liger-dspine: assistant span \(6, 9\)"):
        assistant_loss_mask(8, [(6, 9)])


CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : "
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }} <eot>{% endgeneration %}"
    "{% else %}{{ m['content'] }} <eot>{% endif %} {% endfor %}"
)


def word_tokenizer(template=CHAT_TEMPLATE):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "user", "assistant", ":", "<eot>", "hi", "hello", "there", "bye"]
    model = Tokenizer(WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    model.pre_tokenizer = WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>")
    tokenizer.chat_template = template
    return tokenizer


def test_chat_loss_mask_supervises_the_assistant_turns():
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello there"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "bye"},
    ]
    input_ids, mask = chat_loss_mask(word_tokenizer(), messages)
    # user : hi <eot> assistant : hello there <eot> user : bye <eot> assistant : bye <eot>
    assert input_ids.tolist() == [1, 3, 5, 4, 2, 3, 6, 7, 4, 1, 3, 8, 4, 2, 3, 8, 4]
    assert mask.tolist() == [0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1]
    with pytest.raises(ValueError, match=r"^liger-dspine: the chat template marked no assistant token"):
        chat_loss_mask(
            word_tokenizer(CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")), messages
        )


# ----------------------------------------------------------------------------------------------- the objective
def make_objective(target, seed=5):
    torch.manual_seed(seed)
    draft = DSpineDraftModel(tiny_draft_config())
    return DSpineObjective(draft, target.lm_head, target.model.embed_tokens, num_anchors=4).train()


def test_objective_on_captured_inputs_matches_and_trains():
    target = tiny_target()
    input_ids = torch.randint(0, TINY_MASK_TOKEN, (2, 16), generator=torch.Generator().manual_seed(7))
    captured = TargetCapture(target, tiny_draft_config().target_layer_ids)(input_ids)
    reference_batch = target_batch(target, input_ids)
    objective = make_objective(target)
    torch.manual_seed(11)
    with torch.no_grad():
        expected = objective(**reference_batch.as_kwargs(), global_step=10, total_steps=100).loss
    optimizer = torch.optim.AdamW(objective.draft_model.parameters(), lr=1e-2)
    losses = []
    for step in range(6):
        torch.manual_seed(11)  # the same anchors every step: the loss of one batch must fall
        out = objective(**captured, global_step=10, total_steps=100)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(out.loss.item())
    assert losses[0] == pytest.approx(expected.item(), rel=1e-6)
    assert losses[-1] < 0.9 * losses[0], losses
