"""An instance-patched DeepSeek-V3 through ``pickle`` and ``torch.save(model)`` / ``torch.load``: the loaded model is
patched as the saved one was (Liger modules and ``lce_forward``) and gives its loss and gradients.

Tiny model, fp32 on the CPU interpreter. The loaded model runs the same kernels on the same weights and inputs, so
its loss and gradients must equal the original's exactly (tolerance 0); the original is checked against the native
model at 1e-5 (fp32 rounding of differently ordered kernels).
"""

import copy
import copyreg
import fractions
import io
import json
import os
import pickle
import subprocess
import sys
from types import MethodType

import pytest
import torch

from liger_dspine import apply_liger_kernel_to_deepseek_v3
from liger_dspine.modules.causal_lm_forward import lce_forward
from liger_dspine.modules.causal_lm_forward import lce_forward_vocab_chunked
from liger_dspine.modules.rms_norm import LigerRMSNorm
from tiny_models import assert_grads_close
from tiny_models import build_model
from tiny_models import labels_with_ignored
from tiny_models import loss_and_grads
from tiny_models import module_types
from tiny_models import random_batch
from tiny_models import tiny_deepseek_v3_config

EXACT = dict(atol=0.0, rtol=0.0)
FP32 = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def native():
    return build_model(tiny_deepseek_v3_config())


@pytest.fixture(scope="module")
def batch(native):
    input_ids, _ = random_batch(native.config, batch=2, seq=6, seed=5)
    return input_ids, labels_with_ignored(input_ids)


def through_pickle(model):
    return pickle.loads(pickle.dumps(model))


def through_torch_save(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("vocab_chunked", [False, True], ids=["lce_forward", "vocab_chunked"])
@pytest.mark.parametrize("round_trip", [through_pickle, through_torch_save], ids=["pickle", "torch_save"])
def test_loaded_model_is_patched_and_gives_the_same_loss_and_grads(native, batch, round_trip, vocab_chunked):
    input_ids, labels = batch
    model = copy.deepcopy(native).train()
    apply_liger_kernel_to_deepseek_v3(model=model, vocab_chunked_lce=vocab_chunked)
    out, grads = loss_and_grads(model, input_ids, labels=labels)
    native_out, native_grads = loss_and_grads(native.train(), input_ids, labels=labels)
    torch.testing.assert_close(out.loss, native_out.loss, **FP32)
    assert_grads_close(grads, native_grads, **FP32)

    model.zero_grad(set_to_none=True)
    loaded = round_trip(model)

    assert loaded is not model and loaded.forward.__self__ is loaded
    assert loaded.forward.__func__ is (lce_forward_vocab_chunked if vocab_chunked else lce_forward)
    assert module_types(loaded) == module_types(model) and isinstance(loaded.model.norm, LigerRMSNorm)
    loaded_out, loaded_grads = loss_and_grads(loaded, input_ids, labels=labels)
    assert loaded_out.logits is None  # the fused path ran
    torch.testing.assert_close(loaded_out.loss, out.loss, **EXACT)
    assert_grads_close(loaded_grads, grads, **EXACT)


def test_a_fresh_process_loads_the_patched_model_and_can_save_it_again(native, batch, tmp_path):
    input_ids, labels = batch
    model = copy.deepcopy(native).train()
    apply_liger_kernel_to_deepseek_v3(model=model)
    with torch.no_grad():
        loss = model(input_ids, labels=labels).loss
    torch.save({"model": model, "input_ids": input_ids, "labels": labels}, tmp_path / "model.pt")

    code = (
        "import json, pickle, sys, torch\n"
        "import liger_dspine\n"  # enables the CPU interpreter from the environment, as conftest does
        f"saved = torch.load({str(tmp_path / 'model.pt')!r}, weights_only=False)\n"
        "model = saved['model']\n"
        "with torch.no_grad():\n"
        "    loss = model(saved['input_ids'], labels=saved['labels']).loss\n"
        "again = pickle.loads(pickle.dumps(model))\n"
        "print(json.dumps(dict(loss=loss.item(), forward=model.forward.__func__.__name__,\n"
        "    again=again.forward.__func__ is model.forward.__func__ and again.forward.__self__ is again)))\n"
    )
    env = dict(os.environ, LIGER_DSPINE_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["forward"] == "lce_forward" and result["again"] is True
    assert result["loss"] == loss.item()


def test_other_bound_methods_keep_their_own_pickling(native):
    apply_liger_kernel_to_deepseek_v3(model=copy.deepcopy(native))  # registers the reducer
    method = fractions.Fraction(3, 7).limit_denominator
    assert copyreg.dispatch_table[MethodType](method) == method.__reduce__()
    assert pickle.loads(pickle.dumps(method))(2) == fractions.Fraction(1, 2)
