"""Kimi K2.5's loss forwards: transformers' output fields kept, the vocabulary read from text_config, and
transformers' own forward for a batch with an image (tiny model of tiny_family.py, fp32 on CPU)."""

import copy
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tiny_family import CASES  # noqa: E402

pytestmark = pytest.mark.matrix

CASE = CASES["kimi_k25"]
IMAGE_TOKEN = 90  # inside the tiny vocabulary, so that a prompt can hold the placeholder
PATCH = 14  # the vision config's default patch size


@pytest.fixture
def models():
    native = CASE.build(image_token_id=IMAGE_TOKEN)
    patched = copy.deepcopy(native)
    CASE.apply_fn()(model=patched)
    return native, patched


def text_batch():
    return torch.randint(0, 80, (2, 8), generator=torch.Generator().manual_seed(3))


def image_batch():
    """One 28x28 image: 2x2 patches, merged 2x2 into one placeholder token of the first row."""
    generator = torch.Generator().manual_seed(5)
    input_ids = text_batch()
    input_ids[0, 2] = IMAGE_TOKEN
    labels = input_ids.masked_fill(input_ids == IMAGE_TOKEN, -100)
    pixel_values = torch.randn(4, 3, PATCH, PATCH, generator=generator)
    return dict(input_ids=input_ids, labels=labels, pixel_values=pixel_values, image_grid_thw=torch.tensor([[1, 2, 2]]))


def test_text_training_keeps_the_output_fields_and_matches_native_loss(models):
    native, patched = models
    native.train(), patched.train()
    input_ids = text_batch()
    ref = native(input_ids=input_ids, labels=input_ids, output_hidden_states=True)
    out = patched(input_ids=input_ids, labels=input_ids, output_hidden_states=True)
    assert type(out).__name__ == "LigerKimiK25CausalLMOutputWithPast" and isinstance(out, type(ref))
    # transformers' fields of this version (image / video outputs, router logits, cache), then token_accuracy
    assert [f.name for f in fields(out)] == [f.name for f in fields(ref)] + ["token_accuracy"]
    assert out.logits is None and out.token_accuracy is not None  # the fused loss skipped the logits
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=0)
    assert len(out.hidden_states) == len(ref.hidden_states)
    assert set(out.keys()) == set(ref.keys()) - {"logits"} | {"token_accuracy"}


def test_eval_logits_match_native(models):
    native, patched = models
    native.eval(), patched.eval()
    input_ids = text_batch()
    with torch.no_grad():
        ref, out = native(input_ids=input_ids), patched(input_ids=input_ids)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-6)


def test_a_batch_with_an_image_runs_the_native_forward(models):
    native, patched = models
    native.train(), patched.train()
    ref = native(**image_batch())
    out = patched(**image_batch())
    assert type(out) is type(ref)  # transformers' output: no token_accuracy
    assert set(out.keys()) == set(ref.keys())
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-6)
    out.loss.backward()
    assert patched.model.vision_tower.patch_embed.proj.weight.grad is not None


def test_skip_logits_with_an_image_is_refused(models):
    _, patched = models
    with pytest.raises(ValueError, match="liger-dspine: skip_logits=True needs a text-only batch"):
        patched(**image_batch(), skip_logits=True)


def test_labels_are_checked_against_the_text_vocabulary(models):
    _, patched = models
    input_ids = text_batch()
    labels = input_ids.clone()
    labels[0, 1] = CASE.vocab_size
    with pytest.raises(ValueError, match=rf"liger-dspine: labels must be in \[0, {CASE.vocab_size}\)"):
        patched(input_ids=input_ids, labels=labels)
