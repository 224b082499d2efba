"""Mistral-Small-4 as its checkpoints load (``mistral3``: a mistral4 text model under a Pixtral vision tower): the
text-only loss forward keeps transformers' output fields, a batch with an image runs transformers' forward, a
Mistral-Small-3 model (mistral text) is refused, and the class patch shares Mistral4's classes with the mistral4
patch (tiny model of tiny_family.py, fp32 on CPU)."""

import copy
import importlib
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tiny_family import CASES  # noqa: E402

pytestmark = pytest.mark.matrix

CASE = CASES["mistral3"]


@pytest.fixture
def models():
    native = CASE.build()
    patched = copy.deepcopy(native)
    CASE.apply_fn()(model=patched)
    return native, patched


def text_batch():
    return torch.randint(11, 80, (2, 8), generator=torch.Generator().manual_seed(3))


def image_batch(config):
    """One 8x8 image: 2x2 patches of 4 pixels, one placeholder token each, in the first row."""
    input_ids = text_batch()
    input_ids[0, 1:5] = config.image_token_id
    pixel_values = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(5))
    labels = input_ids.masked_fill(input_ids == config.image_token_id, -100)
    return dict(input_ids=input_ids, labels=labels, pixel_values=pixel_values, image_sizes=torch.tensor([[8, 8]]))


def test_text_training_keeps_the_output_fields_and_matches_native(models):
    native, patched = models
    input_ids = text_batch()
    native.zero_grad(), patched.zero_grad()
    ref = native.train()(input_ids=input_ids, labels=input_ids)
    out = patched.train()(input_ids=input_ids, labels=input_ids)
    assert type(out).__name__ == "LigerMistral3CausalLMOutputWithPast" and isinstance(out, type(ref))
    assert [f.name for f in fields(out)] == [f.name for f in fields(ref)] + ["token_accuracy"]
    assert out.logits is None and out.token_accuracy is not None
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=0)
    ref.loss.backward(), out.loss.backward()
    for (name, p), q in zip(native.named_parameters(), patched.parameters()):
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_a_batch_with_an_image_runs_the_native_forward(models):
    native, patched = models
    batch = image_batch(native.config)
    ref = native.train()(**batch)
    out = patched.train()(**batch)
    assert type(out) is type(ref)  # transformers' output: no token_accuracy
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="liger-dspine: skip_logits=True needs a text-only batch"):
        patched(**batch, skip_logits=True)


def test_a_mistral_small_3_model_is_refused():
    mistral_text = dict(
        model_type="mistral",
        vocab_size=CASE.vocab_size,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = CASE.build(text_config=mistral_text)
    with pytest.raises(ValueError, match="covers Mistral-Small-4 .* text model is 'mistral'"):
        CASE.apply_fn()(model=model)
    assert "forward" not in vars(model)


def test_the_mistral3_and_mistral4_class_patches_share_mistral4s_classes():
    from liger_dspine import apply_liger_kernel_to_mistral3
    from liger_dspine import apply_liger_kernel_to_mistral4
    from liger_dspine import revert_liger_kernel_to_mistral3
    from liger_dspine import revert_liger_kernel_to_mistral4
    from liger_dspine.modules.rms_norm import LigerRMSNorm

    CASE.modeling_or_skip()
    mistral4 = importlib.import_module("transformers.models.mistral4.modeling_mistral4")
    native_norm, native_forward = mistral4.Mistral4RMSNorm, mistral4.Mistral4ForCausalLM.forward
    try:
        apply_liger_kernel_to_mistral4()
        apply_liger_kernel_to_mistral3()
        revert_liger_kernel_to_mistral3()
        assert mistral4.Mistral4RMSNorm is LigerRMSNorm  # the mistral4 patch still holds it
        assert mistral4.Mistral4ForCausalLM.forward is not native_forward
    finally:
        revert_liger_kernel_to_mistral3()
        revert_liger_kernel_to_mistral4()
    assert mistral4.Mistral4RMSNorm is native_norm and mistral4.Mistral4ForCausalLM.forward is native_forward
