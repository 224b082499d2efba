"""transformers' ``set_experts_implementation`` on a patched model: the default grouped GEMMs and the reference loop
are what the patched experts compute; another implementation is refused by name rather than ignored."""

import copy

import pytest
import torch

from liger_dspine import apply_liger_kernel_to_deepseek_v3
from tiny_models import build_model
from tiny_models import random_batch
from tiny_models import tiny_deepseek_v3_config


@pytest.fixture(scope="module")
def models():
    config = tiny_deepseek_v3_config()
    native = build_model(config).eval()
    patched = copy.deepcopy(native)
    apply_liger_kernel_to_deepseek_v3(model=patched)
    return native, patched, random_batch(config, batch=1, seq=5)[0]


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_the_implementations_the_patch_computes_run_it(models, implementation):
    native, patched, input_ids = models
    for model in (native, patched):
        model.set_experts_implementation(implementation)
    with torch.no_grad():
        torch.testing.assert_close(patched(input_ids).logits, native(input_ids).logits, rtol=1e-5, atol=1e-5)


def test_another_implementation_is_refused_by_name(models):
    _, patched, input_ids = models
    patched.set_experts_implementation("batched_mm")
    try:
        with pytest.raises(ValueError, match="experts_implementation='batched_mm'.*grouped_experts=False"):
            patched(input_ids)
    finally:
        patched.set_experts_implementation("grouped_mm")
