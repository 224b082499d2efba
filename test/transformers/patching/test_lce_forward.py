"""``lce_forward`` and ``ce_forward`` against the native ``DeepseekV3ForCausalLM.forward`` (fp32, CPU interpreter).

Only the forward is swapped here (every other option off): the decoder is native, so any
difference comes from the loss path. Tolerance 1e-5: fp32 rounding of a chunked, differently ordered reduction.
"""

import copy
import importlib

import pytest
import torch

from liger_dspine import apply_liger_kernel_to_deepseek_v3
from liger_dspine.modules import causal_lm_forward
from liger_dspine.modules.causal_lm_forward import ce_forward
from liger_dspine.modules.causal_lm_forward import lce_forward
from liger_dspine.modules.causal_lm_forward import lce_forward_vocab_chunked
from tiny_models import IGNORE_INDEX
from tiny_models import assert_grads_close
from tiny_models import build_model
from tiny_models import grads_of
from tiny_models import loss_and_grads
from tiny_models import random_batch
from tiny_models import tiny_deepseek_v3_config

pytestmark = pytest.mark.matrix  # runs against every transformers version of the matrix

FP32 = dict(atol=1e-5, rtol=1e-5)
ONLY_LOSS_FORWARD = dict(rope=False, rms_norm=False, swiglu=False, moe_router=False)


@pytest.fixture(scope="module")
def native_model():
    return build_model(tiny_deepseek_v3_config())


@pytest.fixture
def native(native_model):
    return copy.deepcopy(native_model)


def fused_loss_model(native_model, vocab_chunked: bool):
    """The fused loss forward: liger-kernel's (token chunks) or this package's vocabulary-chunked one."""
    model = copy.deepcopy(native_model)
    apply_liger_kernel_to_deepseek_v3(model=model, vocab_chunked_lce=vocab_chunked, **ONLY_LOSS_FORWARD)
    assert model.forward.__func__ is (lce_forward_vocab_chunked if vocab_chunked else lce_forward)
    return model


@pytest.fixture(params=[False, True], ids=["token_chunks", "vocab_chunks"])
def lce(native_model, request):
    return fused_loss_model(native_model, request.param)


@pytest.fixture
def lce_tokens(native_model):
    return fused_loss_model(native_model, False)


@pytest.fixture
def lce_vocab(native_model):
    return fused_loss_model(native_model, True)


@pytest.fixture
def ce(native_model):
    model = copy.deepcopy(native_model)
    apply_liger_kernel_to_deepseek_v3(
        model=model, cross_entropy=True, fused_linear_cross_entropy=False, **ONLY_LOSS_FORWARD
    )
    assert model.forward.__func__ is ce_forward
    return model


@pytest.fixture(scope="module")
def batch(native_model):
    """(input_ids [4, 7], labels): every 3rd label ignored, and about half of the others equal to the native
    model's greedy prediction, so that token accuracy is neither 0 nor 1."""
    config = native_model.config
    input_ids, _ = random_batch(config, batch=4, seq=7, seed=3)
    with torch.no_grad():
        predicted = native_model.eval()(input_ids).logits.argmax(-1)
    native_model.train()
    generator = torch.Generator().manual_seed(4)
    labels = torch.randint(0, config.vocab_size, input_ids.shape, generator=generator)
    hit = torch.rand(input_ids.shape, generator=generator) < 0.5
    labels[:, 1:] = torch.where(hit[:, 1:], predicted[:, :-1], labels[:, 1:])
    labels[:, ::3] = IGNORE_INDEX
    return input_ids, labels


def shifted(labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]


def accuracy_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    targets = shifted(labels)
    kept = targets != IGNORE_INDEX
    return (logits.argmax(-1) == targets)[kept].float().mean()


def test_training_with_labels_skips_logits(native, lce, batch):
    input_ids, labels = batch
    native_out, native_grads = loss_and_grads(native.train(), input_ids, labels=labels)
    out, grads = loss_and_grads(lce.train(), input_ids, labels=labels)

    assert out.logits is None
    torch.testing.assert_close(out.loss, native_out.loss, **FP32)
    assert_grads_close(grads, native_grads, **FP32)
    expected_accuracy = accuracy_from_logits(native_out.logits, labels)
    assert 0.2 < expected_accuracy < 0.8
    torch.testing.assert_close(out.token_accuracy, expected_accuracy, atol=1e-6, rtol=0)


def test_skip_logits_false_gives_logits_and_the_same_loss(native, lce, batch):
    input_ids, labels = batch
    native_out, native_grads = loss_and_grads(native.train(), input_ids, labels=labels)
    out, grads = loss_and_grads(lce.train(), input_ids, labels=labels, skip_logits=False)

    torch.testing.assert_close(out.logits, native_out.logits, **FP32)
    torch.testing.assert_close(out.loss, native_out.loss, **FP32)
    assert_grads_close(grads, native_grads, **FP32)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_skip_logits_without_labels_is_an_error(lce, batch, training):
    lce.train(training)
    with pytest.raises(ValueError, match="skip_logits=True needs labels"):
        lce(batch[0], skip_logits=True)


def test_eval_gives_native_logits_and_loss(native, lce, batch):
    input_ids, labels = batch
    native.eval(), lce.eval()
    with torch.no_grad():
        native_out = native(input_ids, labels=labels)
        out = lce(input_ids, labels=labels)
        unlabelled = lce(input_ids)
        skipped = lce(input_ids, labels=labels, skip_logits=True)

    torch.testing.assert_close(out.logits, native_out.logits, **FP32)
    torch.testing.assert_close(out.loss, native_out.loss, **FP32)
    torch.testing.assert_close(unlabelled.logits, native_out.logits, **FP32)
    assert unlabelled.loss is None
    # skip_logits=True forces the fused loss in eval too
    assert skipped.logits is None
    torch.testing.assert_close(skipped.loss, native_out.loss, **FP32)


# transformers added 2-D positions and boolean masks for logits_to_keep (slice_logits_to_keep) after 5.17
NEEDS_2D_KEEP = pytest.mark.skipif(
    not hasattr(importlib.import_module("transformers.modeling_utils"), "slice_logits_to_keep"),
    reason="this transformers version's native forward takes only int or 1-D logits_to_keep",
)


@pytest.mark.parametrize(
    "logits_to_keep",
    [
        1,
        3,
        torch.tensor([0, 4, 6]),
        pytest.param(
            torch.tensor([[0, 5], [2, 6], [1, 1], [6, 3]]), marks=NEEDS_2D_KEEP
        ),  # per-sample positions [B, P]
        pytest.param(torch.arange(28).reshape(4, 7) % 3 == 1, marks=NEEDS_2D_KEEP),  # boolean mask [B, S]
    ],
    ids=["last", "last_3", "positions", "positions_per_sample", "mask"],
)
def test_logits_to_keep_selects_native_positions(native, lce, batch, logits_to_keep):
    input_ids, _ = batch
    native.eval(), lce.eval()
    with torch.no_grad():
        expected = native(input_ids, logits_to_keep=logits_to_keep).logits
        actual = lce(input_ids, logits_to_keep=logits_to_keep).logits

    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, **FP32)


def test_labels_not_matching_kept_positions_are_an_error(lce, batch):
    input_ids, labels = batch
    with pytest.raises(ValueError, match="logits_to_keep"):
        lce.train()(input_ids, labels=labels, logits_to_keep=2)


@pytest.mark.parametrize("variant", ["lce_tokens", "lce_vocab", "ce"])
def test_gradient_accumulation_with_num_items_in_batch(request, native, batch, variant):
    """Two micro-batches, each loss divided by the token count of both: their sum and summed gradients equal
    one forward over the whole batch, and each micro-batch loss equals the native one."""
    model = request.getfixturevalue(variant).train()
    native.train()
    input_ids, labels = batch
    whole_out, whole_grads = loss_and_grads(model, input_ids, labels=labels)
    num_items = (shifted(labels) != IGNORE_INDEX).sum()

    model.zero_grad(set_to_none=True)
    total = 0.0
    for part in (slice(0, 2), slice(2, 4)):
        out = model(input_ids[part], labels=labels[part], num_items_in_batch=num_items)
        out.loss.backward()
        total = total + out.loss.detach()
        with torch.no_grad():
            native_loss = native(input_ids[part], labels=labels[part], num_items_in_batch=num_items).loss
        torch.testing.assert_close(out.loss.detach(), native_loss, **FP32)

    torch.testing.assert_close(total, whole_out.loss.detach(), **FP32)
    assert_grads_close(grads_of(model), whole_grads, **FP32)


def test_return_dict_false_keeps_the_logits_slot(native, lce, batch):
    input_ids, labels = batch
    with torch.no_grad():
        expected = lce.train()(input_ids, labels=labels)
        training = lce(input_ids, labels=labels, return_dict=False)
        native_training = native.train()(input_ids, labels=labels, return_dict=False)
        native_logits = native.eval()(input_ids).logits
        evaluation = lce.eval()(input_ids, return_dict=False)

    assert isinstance(training, tuple) and isinstance(evaluation, tuple)
    loss, logits = training[:2]  # transformers' order: the skipped logits keep their slot
    torch.testing.assert_close(loss, expected.loss, atol=0, rtol=0)
    torch.testing.assert_close(loss, native_training[0], **FP32)
    assert logits is None and expected.logits is None
    # transformers' fields first (same count as the native tuple), then token_accuracy
    assert len(training) == len(native_training) + 1
    for ours, theirs in zip(training[2:-1], native_training[2:]):
        assert type(ours) is type(theirs)
    torch.testing.assert_close(training[-1], expected.token_accuracy, atol=0, rtol=0)
    assert 0 < training[-1].item() < 1
    torch.testing.assert_close(evaluation[0], native_logits, **FP32)


def test_return_dict_false_with_logits_is_the_native_tuple(native, ce, batch):
    input_ids, labels = batch
    with torch.no_grad():
        ours = ce.train()(input_ids, labels=labels, return_dict=False)
        theirs = native.train()(input_ids, labels=labels, return_dict=False)

    assert len(ours) == len(theirs)
    loss, logits = ours[:2]
    torch.testing.assert_close(loss, theirs[0], **FP32)
    torch.testing.assert_close(logits, theirs[1], **FP32)


@pytest.mark.parametrize("variant", ["lce_tokens", "lce_vocab", "ce"])
def test_shift_labels_give_the_loss_of_labels(request, native, batch, variant):
    model = request.getfixturevalue(variant).train()
    input_ids, labels = batch
    native_out, native_grads = loss_and_grads(native.train(), input_ids, labels=labels)

    out, grads = loss_and_grads(model, input_ids, shift_labels=shifted(labels))

    torch.testing.assert_close(out.loss, native_out.loss, **FP32)
    assert_grads_close(grads, native_grads, **FP32)
    with torch.no_grad():
        evaluation = model.eval()(input_ids, shift_labels=shifted(labels))
    torch.testing.assert_close(evaluation.loss, native_out.loss, **FP32)


def test_shift_labels_of_the_wrong_shape_are_an_error(lce, batch):
    input_ids, labels = batch
    with pytest.raises(ValueError, match="do not match"):
        lce.train()(input_ids, shift_labels=labels[:, 1:])


def test_ce_forward_gives_logits_and_native_loss(native, ce, batch):
    input_ids, labels = batch
    native_out, native_grads = loss_and_grads(native.train(), input_ids, labels=labels)
    out, grads = loss_and_grads(ce.train(), input_ids, labels=labels)

    torch.testing.assert_close(out.logits, native_out.logits, **FP32)
    torch.testing.assert_close(out.loss, native_out.loss, **FP32)
    assert_grads_close(grads, native_grads, **FP32)


def test_greedy_generation_matches_native(native, lce, batch):
    input_ids = batch[0][:1]
    native.eval(), lce.eval()
    with torch.no_grad():
        expected = native.generate(input_ids, max_new_tokens=4, do_sample=False)
        actual = lce.generate(input_ids, max_new_tokens=4, do_sample=False)

    assert torch.equal(actual, expected)


@pytest.mark.parametrize("chunk_bytes", [0, 2**40], ids=["liger_rule", "one_chunk"])
def test_token_chunk_budget_keeps_the_native_loss(native, lce_tokens, batch, monkeypatch, chunk_bytes):
    """Liger's own chunking (many chunks at these sizes) and a single chunk give the native loss and gradients."""
    monkeypatch.setattr(causal_lm_forward, "FUSED_CE_CHUNK_BYTES", chunk_bytes)
    input_ids, labels = batch
    native_out, native_grads = loss_and_grads(native.train(), input_ids, labels=labels)
    out, grads = loss_and_grads(lce_tokens.train(), input_ids, labels=labels)
    torch.testing.assert_close(out.loss, native_out.loss, **FP32)
    assert_grads_close(grads, native_grads, **FP32)


def test_token_chunk_budget_at_deepseek_v3_widths():
    """chunk_mem_const at vocab 129280 / hidden 7168, bf16: liger's chunk count from it (its own formula)."""

    def chunks(tokens):
        const = causal_lm_forward.fused_ce_chunk_mem_const(tokens, 7168, 2)
        per_chunk = 1 << (-(-tokens // -(-129280 // (const * 7168))) - 1).bit_length()
        return -(-tokens // min(per_chunk, tokens))

    assert [chunks(t) for t in (4096, 8192, 16384, 32768)] == [2, 4, 8, 16]
    assert causal_lm_forward.fused_ce_chunk_mem_const(32768, 7168, 2) == 1  # liger-kernel's own rule at long sequences


def test_accum_dtype_reaches_liger_kernel_and_keeps_the_native_loss(native, lce_tokens, batch, monkeypatch):
    """liger-kernel's ``accum_dtype`` keyword (its mini-model tests pass fp32) is handed to its fused loss, not
    dropped, and the loss and gradients stay native's."""
    from liger_dspine.ops import liger_kernel_ops

    seen = []
    original = liger_kernel_ops.fused_linear_cross_entropy_forward

    def spy(*args, **kwargs):
        seen.append(kwargs.get("accum_dtype"))
        return original(*args, **kwargs)

    monkeypatch.setattr(liger_kernel_ops, "fused_linear_cross_entropy_forward", spy)
    monkeypatch.setattr(causal_lm_forward, "FUSED_CE_CHUNK_BYTES", 0)  # several token chunks to sum over
    input_ids, labels = batch
    native_out, native_grads = loss_and_grads(native.train(), input_ids, labels=labels, accum_dtype=torch.float32)
    out, grads = loss_and_grads(lce_tokens.train(), input_ids, labels=labels, accum_dtype=torch.float32)
    assert seen == [torch.float32]
    torch.testing.assert_close(out.loss, native_out.loss, **FP32)
    assert_grads_close(grads, native_grads, **FP32)


@pytest.mark.parametrize("value", [torch.int32, "float32", 32])
def test_accum_dtype_that_is_not_a_float_dtype_is_an_error(lce, batch, value):
    input_ids, labels = batch
    with pytest.raises(TypeError, match="accum_dtype must be a floating torch.dtype"):
        lce.train()(input_ids, labels=labels, accum_dtype=value)


@pytest.mark.cuda
def test_accum_dtype_fp32_sums_the_head_gradient_closer_to_fp32(native_model, monkeypatch):
    """bf16 on CUDA, many token chunks: the head's gradient summed in fp32 (``accum_dtype=torch.float32``) is at
    least as close to an fp32 run's as the one summed in bf16."""
    monkeypatch.setattr(causal_lm_forward, "FUSED_CE_CHUNK_BYTES", 0)
    model = fused_loss_model(native_model, False).cuda()
    input_ids, labels = random_batch(model.config, batch=8, seq=64, seed=5)
    input_ids, labels = input_ids.cuda(), labels.cuda()
    _, reference = loss_and_grads(model.train(), input_ids, labels=labels)
    model = model.to(torch.bfloat16)
    errors = {}
    for accum_dtype in (None, torch.float32):
        _, grads = loss_and_grads(model, input_ids, labels=labels, accum_dtype=accum_dtype)
        head, expected = grads["lm_head.weight"].float(), reference["lm_head.weight"]
        errors[accum_dtype] = ((head - expected).norm() / expected.norm()).item()
    assert errors[torch.float32] <= errors[None], errors
