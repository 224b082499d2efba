"""``AutoLigerDSpineForCausalLM``: patch options go to the patch, the rest to transformers; outputs equal native.

The checkpoint is saved in bf16, so ``dtype=torch.float32`` visibly reaches transformers (without it the model
loads in bf16). Logits are compared in fp32 eval mode; the kernels run through the interpreter on a CPU.
"""

import pytest
import torch
from transformers import AutoConfig
from transformers import AutoModelForCausalLM
from transformers import DeepseekV3ForCausalLM
from transformers import LlamaConfig

from liger_dspine import AutoLigerDSpineForCausalLM
from liger_dspine.modules.causal_lm_forward import lce_forward
from liger_dspine.modules.experts import LigerFusedExperts
from liger_dspine.modules.grouped_experts import LigerGroupedExperts
from liger_dspine.modules.rms_norm import LigerRMSNorm
from liger_dspine.modules.swiglu import LigerSwiGLUMLP
from liger_dspine.patching import replacement_of
from tiny_models import build_model
from tiny_models import changed_modeling_globals
from tiny_models import class_patches_reverted
from tiny_models import module_types
from tiny_models import random_batch
from tiny_models import snapshot_modeling_globals
from tiny_models import tiny_deepseek_v3_config

pytestmark = pytest.mark.matrix  # runs against every transformers version of the matrix

# fp32 kernels through the interpreter against eager fp32: rounding differences only
ATOL = RTOL = 1e-5


@pytest.fixture
def class_level():
    with class_patches_reverted() as before:
        yield before


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_deepseek_v3")
    build_model(tiny_deepseek_v3_config()).to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def native(checkpoint):
    """(native fp32 model loaded from the checkpoint, input ids, its eval logits)."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    input_ids, _ = random_batch(model.config, batch=1, seq=6)
    with torch.no_grad():
        logits = model(input_ids).logits
    return model, input_ids, logits


def kinds(model) -> list[type]:
    return list(module_types(model).values())


def test_checkpoint_loads_in_bf16_without_dtype(checkpoint):
    assert AutoModelForCausalLM.from_pretrained(checkpoint).dtype == torch.bfloat16


def test_from_pretrained_splits_patch_options_from_transformers_kwargs(class_level, checkpoint, native):
    native_model, input_ids, native_logits = native

    model = AutoLigerDSpineForCausalLM.from_pretrained(checkpoint, swiglu=False, dtype=torch.float32).eval()

    assert type(model) is DeepseekV3ForCausalLM
    assert model.dtype == torch.float32
    assert not hasattr(model.config, "swiglu")
    types = kinds(model)
    assert types.count(LigerRMSNorm) == 9 and LigerSwiGLUMLP not in types and LigerFusedExperts not in types
    assert LigerGroupedExperts not in types  # routed experts follow swiglu
    assert replacement_of(DeepseekV3ForCausalLM.forward) is lce_forward
    assert model.state_dict().keys() == native_model.state_dict().keys()
    with torch.no_grad():
        logits = model(input_ids).logits
    torch.testing.assert_close(logits, native_logits, atol=ATOL, rtol=RTOL)


def test_from_pretrained_with_a_given_config(class_level, checkpoint, native):
    _, input_ids, native_logits = native
    config = AutoConfig.from_pretrained(checkpoint)

    model = AutoLigerDSpineForCausalLM.from_pretrained(
        checkpoint, config=config, rms_norm=False, swiglu=False, dtype=torch.float32
    ).eval()

    types = kinds(model)
    assert LigerRMSNorm not in types and LigerSwiGLUMLP not in types
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids).logits, native_logits, atol=ATOL, rtol=RTOL)


def test_from_config_patches_then_builds(class_level, native):
    native_model, input_ids, native_logits = native

    model = AutoLigerDSpineForCausalLM.from_config(
        native_model.config, rms_norm=False, fused_experts=True, dtype=torch.float32
    )

    assert model.dtype == torch.float32
    types = kinds(model)
    assert LigerRMSNorm not in types
    assert types.count(LigerSwiGLUMLP) == 2 and types.count(LigerFusedExperts) == 1
    model.load_state_dict(native_model.state_dict())
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids).logits, native_logits, atol=ATOL, rtol=RTOL)


def test_unsupported_model_type_is_refused_before_patching():
    before = snapshot_modeling_globals()
    config = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )

    with pytest.raises(ValueError, match=r"no patch for model type 'llama'; supported: .*deepseek_v3"):
        AutoLigerDSpineForCausalLM.from_config(config)

    assert changed_modeling_globals(before) == []
