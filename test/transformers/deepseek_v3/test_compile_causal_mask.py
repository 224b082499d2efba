"""torch.compile of a patched DeepSeek-V3 on sdpa: no materialised causal mask where the mask can only be causal.

transformers before 5.24 builds the [S, S] causal mask in every compiled step instead of leaving sdpa its
``is_causal``; 5.24 and later do so where dynamo folds ``torch.compiler.is_exporting()`` to True (torch 2.11). The
tests reproduce the latter by making transformers' exporting check answer True while compiling (where it has one),
read the sdpa calls out of the graph dynamo captured, and compare the compiled loss and gradients with the native
eager model's.
"""

import copy

import pytest
import torch

from liger_dspine import apply_liger_kernel_to_deepseek_v3
from tiny_models import assert_grads_close
from tiny_models import build_model
from tiny_models import compiled_sdpa_step
from tiny_models import exporting_while_compiling
from tiny_models import labels_with_ignored
from tiny_models import loss_and_grads
from tiny_models import random_batch
from tiny_models import tiny_deepseek_v3_config

pytestmark = [pytest.mark.slow, pytest.mark.matrix]  # dynamo over the interpreter's kernels


@pytest.fixture(scope="module")
def native_model():
    return build_model(tiny_deepseek_v3_config(attn_implementation="sdpa"))


@pytest.fixture(scope="module")
def batch(native_model):
    input_ids, _ = random_batch(native_model.config, batch=2, seq=6, seed=3)
    return input_ids, labels_with_ignored(input_ids)


@pytest.fixture
def mask_check_as_torch_2_11(monkeypatch):
    exporting_while_compiling(monkeypatch)


def test_compiled_step_takes_is_causal_and_gives_the_native_loss_and_grads(
    native_model, batch, mask_check_as_torch_2_11
):
    input_ids, labels = batch
    native, native_grads = loss_and_grads(copy.deepcopy(native_model).train(), input_ids, labels=labels)
    model = copy.deepcopy(native_model).train()
    apply_liger_kernel_to_deepseek_v3(model=model)

    out, grads, calls = compiled_sdpa_step(model, input_ids, labels=labels)

    layers = native_model.config.num_hidden_layers
    assert calls == [(True, True)] * layers
    torch.testing.assert_close(out.loss, native.loss, atol=1e-5, rtol=1e-5)
    assert_grads_close(grads, native_grads, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("given", ["attention_mask", "position_ids"])
def test_a_padding_mask_or_position_ids_keep_the_models_mask(native_model, batch, mask_check_as_torch_2_11, given):
    """Padding, or position ids that may pack several sequences: the mask transformers builds is what sdpa gets."""
    input_ids, labels = batch
    if given == "attention_mask":
        value = torch.ones_like(input_ids)
        value[1, :2] = 0  # left padding in the second row
    else:
        value = torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5]])  # two sequences packed in the first row
    native, native_grads = loss_and_grads(
        copy.deepcopy(native_model).train(), input_ids, labels=labels, **{given: value}
    )
    model = copy.deepcopy(native_model).train()
    apply_liger_kernel_to_deepseek_v3(model=model)

    out, grads, calls = compiled_sdpa_step(model, input_ids, labels=labels, **{given: value})

    assert calls == [(False, False)] * native_model.config.num_hidden_layers
    torch.testing.assert_close(out.loss, native.loss, atol=1e-5, rtol=1e-5)
    assert_grads_close(grads, native_grads, atol=1e-5, rtol=1e-5)
