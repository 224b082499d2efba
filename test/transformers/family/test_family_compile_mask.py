"""torch.compile of patched family models on sdpa, with transformers' mask check as torch 2.11's dynamo answers it.

``modules/causal_mask.py``: where the mask can only be the causal one, the compiled causal-LM forward tells the MLA
attention to leave sdpa its ``is_causal``. A DSA model folds its key selection into the mask and keeps it; a model
whose attention is transformers' own ignores the flag; a multimodal model's text-only batch takes the flag like its
text model. Each compiled step must give the native eager loss and gradients.
"""

import copy

import pytest
import torch

from tiny_family import CASES
from tiny_models import assert_grads_close
from tiny_models import compiled_sdpa_step
from tiny_models import exporting_while_compiling
from tiny_models import loss_and_grads

pytestmark = pytest.mark.slow  # dynamo over the interpreter's kernels


@pytest.mark.parametrize(
    "model_type, mask_free",
    [("glm4_moe_lite", True), ("kimi_k25", True), ("deepseek_v32", False), ("dots1", False)],
)
def test_compiled_family_step_gives_the_native_numbers(monkeypatch, model_type, mask_free):
    exporting_while_compiling(monkeypatch)
    case = CASES[model_type]
    native = case.build()
    native.set_attn_implementation("sdpa")
    input_ids = torch.randint(0, case.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    expected, expected_grads = loss_and_grads(copy.deepcopy(native).train(), input_ids, labels=input_ids)
    model = copy.deepcopy(native).train()
    case.apply_fn()(model=model)
    out, grads, calls = compiled_sdpa_step(model, input_ids, labels=input_ids, fullgraph=False)

    assert calls == [(mask_free, mask_free)] * 2  # sdpa's is_causal exactly where it gets no mask
    torch.testing.assert_close(out.loss, expected.loss, atol=1e-5, rtol=1e-5)
    assert_grads_close(grads, expected_grads, atol=1e-5, rtol=1e-5)
