"""``lce_forward`` with what a training script may bring: a LoRA adapter or a hook on ``lm_head``, a custom
``ignore_index``, labels whose first position is never a target, labels of the wrong type, and liger-kernel's loss
keywords. Against the native ``DeepseekV3ForCausalLM.forward`` (fp32, CPU interpreter, only the forward swapped)."""

import copy

import pytest
import torch

from liger_dspine import apply_liger_kernel_to_deepseek_v3
from tiny_models import IGNORE_INDEX
from tiny_models import assert_grads_close
from tiny_models import build_model
from tiny_models import loss_and_grads
from tiny_models import random_batch
from tiny_models import tiny_deepseek_v3_config

pytestmark = pytest.mark.matrix

FP32 = dict(atol=1e-5, rtol=1e-5)
ONLY_LOSS_FORWARD = dict(rope=False, rms_norm=False, swiglu=False, moe_router=False)


@pytest.fixture(scope="module")
def native_model():
    return build_model(tiny_deepseek_v3_config())


@pytest.fixture
def pair(native_model):
    native, patched = copy.deepcopy(native_model).train(), copy.deepcopy(native_model).train()
    apply_liger_kernel_to_deepseek_v3(model=patched, **ONLY_LOSS_FORWARD)
    return native, patched


@pytest.fixture(scope="module")
def batch(native_model):
    input_ids, labels = random_batch(native_model.config, batch=2, seq=7, seed=5)
    labels[:, ::3] = IGNORE_INDEX
    return input_ids, labels


def lora_on_head(model):
    peft = pytest.importorskip("peft")
    torch.manual_seed(1)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["lm_head"], init_lora_weights=False))
    return wrapped


def test_a_lora_adapter_on_the_head_is_in_the_loss_and_gets_gradients(pair, batch):
    native, patched = (lora_on_head(model) for model in pair)
    input_ids, labels = batch
    expected, expected_grads = loss_and_grads(native, input_ids=input_ids, labels=labels)
    with pytest.warns(UserWarning, match="not a plain torch.nn.Linear.*computed from the head's logits"):
        out, grads = loss_and_grads(patched, input_ids=input_ids, labels=labels)
    torch.testing.assert_close(out.loss, expected.loss, **FP32)
    assert_grads_close(grads, expected_grads, **FP32)
    assert any("lora_B" in name and grad.abs().sum() > 0 for name, grad in grads.items())


def test_skip_logits_with_a_head_the_fused_loss_would_not_compute_is_an_error(pair, batch):
    patched = lora_on_head(pair[1])
    with pytest.raises(ValueError, match="skip_logits=True, but lm_head is a .*lora"):
        patched(batch[0], labels=batch[1], skip_logits=True)


def test_a_forward_hook_on_the_head_is_in_the_loss(pair, batch):
    def hook(module, inputs, output):
        return output * 0.5 + 1.0

    for model in pair:
        model.lm_head.register_forward_hook(hook)
    native, patched = pair
    expected, expected_grads = loss_and_grads(native, batch[0], labels=batch[1])
    with pytest.warns(UserWarning, match="lm_head has forward hooks"):
        out, grads = loss_and_grads(patched, batch[0], labels=batch[1])
    torch.testing.assert_close(out.loss, expected.loss, **FP32)
    assert_grads_close(grads, expected_grads, **FP32)


def test_a_head_with_a_bias_is_in_the_loss(pair, batch):
    native, patched = pair
    head = native.lm_head
    torch.manual_seed(3)
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
    native.lm_head, patched.lm_head = biased, copy.deepcopy(biased)
    expected, expected_grads = loss_and_grads(native, batch[0], labels=batch[1])
    with pytest.warns(UserWarning, match="lm_head has a bias"):
        out, grads = loss_and_grads(patched, batch[0], labels=batch[1])
    torch.testing.assert_close(out.loss, expected.loss, **FP32)
    assert_grads_close(grads, expected_grads, **FP32)
    assert grads["lm_head.bias"].abs().sum() > 0


@pytest.mark.parametrize("vocab_chunked", [False, True], ids=["token_chunks", "vocab_chunks"])
@pytest.mark.parametrize("ignore_index", [-1, 0])
def test_a_custom_ignore_index_gives_the_native_loss(native_model, batch, vocab_chunked, ignore_index):
    native = copy.deepcopy(native_model).train()
    patched = copy.deepcopy(native_model).train()
    apply_liger_kernel_to_deepseek_v3(model=patched, vocab_chunked_lce=vocab_chunked, **ONLY_LOSS_FORWARD)
    input_ids, labels = batch
    labels = labels.masked_fill(labels == IGNORE_INDEX, ignore_index)
    expected, expected_grads = loss_and_grads(native, input_ids, labels=labels, ignore_index=ignore_index)
    out, grads = loss_and_grads(patched, input_ids, labels=labels, ignore_index=ignore_index)
    assert out.logits is None
    torch.testing.assert_close(out.loss, expected.loss, **FP32)
    assert_grads_close(grads, expected_grads, **FP32)
    kept = labels[:, 1:] != ignore_index
    assert 0 < kept.sum() < kept.numel()


def test_ce_forward_takes_the_ignore_index_too(native_model, batch):
    native = copy.deepcopy(native_model).train()
    patched = copy.deepcopy(native_model).train()
    apply_liger_kernel_to_deepseek_v3(
        model=patched, cross_entropy=True, fused_linear_cross_entropy=False, **ONLY_LOSS_FORWARD
    )
    input_ids, labels = batch
    labels = labels.masked_fill(labels == IGNORE_INDEX, -1)
    expected = native(input_ids, labels=labels, ignore_index=-1).loss
    torch.testing.assert_close(patched(input_ids, labels=labels, ignore_index=-1).loss, expected, **FP32)


def test_the_first_label_of_a_row_is_never_a_target_so_its_value_is_not_checked(pair, batch):
    native, patched = pair
    input_ids, labels = batch
    labels = labels.clone()
    labels[:, 0] = native.config.vocab_size + 5  # transformers' loss drops it when it shifts the labels
    expected = native(input_ids, labels=labels).loss
    torch.testing.assert_close(patched(input_ids, labels=labels).loss, expected, **FP32)
    with pytest.raises(ValueError, match="labels must be in"):  # as shift_labels it is a target
        patched(input_ids, shift_labels=labels)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_labels_that_are_not_integers_are_a_type_error(pair, batch, dtype):
    with pytest.raises(TypeError, match=f"labels must be a tensor of integer token ids, got {dtype}"):
        pair[1](batch[0], labels=batch[1].clamp(min=0).to(dtype))


@pytest.mark.parametrize(
    "option", [dict(label_smoothing=0.1), dict(softcap=30.0), dict(ce_weight=torch.ones(96))], ids=lambda o: [*o][0]
)
def test_liger_kernel_loss_options_this_forward_does_not_compute_are_refused(pair, batch, option):
    with pytest.raises(ValueError, match=f"{[*option][0]}=.*liger-kernel's loss options"):
        pair[1](batch[0], labels=batch[1], **option)


def test_liger_kernel_loss_options_at_their_defaults_change_nothing(pair, batch):
    native, patched = pair
    expected = native(batch[0], labels=batch[1]).loss
    loss = patched(batch[0], labels=batch[1], label_smoothing=0.0, softcap=None, return_predicted_tokens=False).loss
    torch.testing.assert_close(loss, expected, **FP32)
