"""The engine where patches meet: two model types sharing classes (kimi_k25's text model is DeepSeek-V3's
classes), an instance patch made under a class-level one, a model class overriding a swapped method, modules of a
class another package put in transformers' place, and a refused call leaving an instance as it was."""

import pytest
import torch
from liger_kernel.transformers.rms_norm import LigerRMSNorm as LigerKernelRMSNorm
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as modeling

from liger_dspine import apply_liger_kernel_to_deepseek_v3
from liger_dspine import apply_liger_kernel_to_kimi_k25
from liger_dspine import revert_liger_kernel_to_deepseek_v3
from liger_dspine import revert_liger_kernel_to_kimi_k25
from liger_dspine.models.deepseek_v3.attention import LigerDeepseekV3Attention
from liger_dspine.modules.causal_lm_forward import lce_forward
from liger_dspine.modules.rms_norm import LigerRMSNorm
from liger_dspine.modules.swiglu import LigerSwiGLUMLP
from liger_dspine.patching import replacement_of
from tiny_models import build_model
from tiny_models import changed_modeling_globals
from tiny_models import class_patches_reverted
from tiny_models import loss_and_grads
from tiny_models import module_types
from tiny_models import random_batch
from tiny_models import snapshot_modeling_globals
from tiny_models import tiny_deepseek_v3_config

pytestmark = pytest.mark.matrix

NATIVE_FORWARD = modeling.DeepseekV3ForCausalLM.forward


@pytest.fixture
def both_reverted():
    with class_patches_reverted() as before:
        yield before
        revert_liger_kernel_to_kimi_k25()


def _kimi_or_skip():
    pytest.importorskip("transformers.models.kimi_k25.modeling_kimi_k25", reason="kimi_k25 needs transformers 5.17")


def _deepseek_v3_patched() -> bool:
    return modeling.DeepseekV3RMSNorm is LigerRMSNorm and modeling.DeepseekV3Attention is LigerDeepseekV3Attention


def test_reverting_kimi_keeps_the_deepseek_v3_patch_that_shares_its_classes(both_reverted):
    _kimi_or_skip()
    apply_liger_kernel_to_deepseek_v3()
    apply_liger_kernel_to_kimi_k25()
    revert_liger_kernel_to_kimi_k25()
    assert _deepseek_v3_patched() and replacement_of(modeling.DeepseekV3ForCausalLM.forward) is lce_forward
    revert_liger_kernel_to_deepseek_v3()
    assert changed_modeling_globals(both_reverted) == []


def test_reverting_deepseek_v3_keeps_what_kimi_holds(both_reverted):
    _kimi_or_skip()
    apply_liger_kernel_to_kimi_k25()
    apply_liger_kernel_to_deepseek_v3()
    restored = revert_liger_kernel_to_deepseek_v3()
    assert restored == ["transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3ForCausalLM.forward"]
    assert _deepseek_v3_patched() and modeling.DeepseekV3ForCausalLM.forward is NATIVE_FORWARD
    revert_liger_kernel_to_kimi_k25()
    assert changed_modeling_globals(both_reverted) == []


@pytest.mark.parametrize("options", [dict(rms_norm=False), dict(recompute_attention=True)])
def test_undoing_a_shared_swap_held_by_the_other_patch_is_refused(both_reverted, options):
    _kimi_or_skip()
    apply_liger_kernel_to_kimi_k25()
    before = snapshot_modeling_globals()
    with pytest.raises(ValueError, match="through the class-level kimi_k25 patch.*nothing was patched"):
        apply_liger_kernel_to_deepseek_v3(**options)
    assert changed_modeling_globals(before) == []


def test_instance_patch_made_under_the_class_patch_outlives_its_revert():
    config = tiny_deepseek_v3_config()
    input_ids, labels = random_batch(config)
    native = build_model(config)
    expected = loss_and_grads(native, input_ids=input_ids, labels=labels)[0].loss
    model = build_model(config)
    with class_patches_reverted():
        apply_liger_kernel_to_deepseek_v3()
        report = apply_liger_kernel_to_deepseek_v3(model=model)
        line = next(r for r in report if r.target == "DeepseekV3ForCausalLM.forward of the instance")
        assert (line.count, line.already, line.old) == (
            1,
            True,
            f"{NATIVE_FORWARD.__module__}.{NATIVE_FORWARD.__qualname__}",
        )
    assert model.forward.__func__ is lce_forward
    assert isinstance(model.model.norm, LigerRMSNorm)
    loss = loss_and_grads(model, input_ids=input_ids, labels=labels)[0].loss
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


def test_a_model_class_overriding_forward_is_refused_on_an_instance():
    class DoubledLossLM(modeling.DeepseekV3ForCausalLM):
        def forward(self, *args, **kwargs):
            output = super().forward(*args, **kwargs)
            output.loss = output.loss * 2
            return output

    torch.manual_seed(0)
    model = DoubledLossLM(tiny_deepseek_v3_config())
    kinds = module_types(model)
    with pytest.raises(
        ValueError, match="DoubledLossLM, a subclass of DeepseekV3ForCausalLM with a forward of its own"
    ):
        apply_liger_kernel_to_deepseek_v3(model=model)
    assert module_types(model) == kinds and "forward" not in vars(model)
    apply_liger_kernel_to_deepseek_v3(fused_linear_cross_entropy=False, model=model)  # the modules alone are fine
    assert "forward" not in vars(model) and isinstance(model.model.norm, LigerRMSNorm)


def test_modules_of_another_packages_class_patch_are_refused_by_name(monkeypatch):
    monkeypatch.setattr(modeling, "DeepseekV3RMSNorm", LigerKernelRMSNorm)  # as liger-kernel's class patch does
    model = build_model(tiny_deepseek_v3_config())
    kinds = module_types(model)
    with pytest.raises(ValueError, match="liger_kernel.transformers.rms_norm.LigerRMSNorm, which another package's"):
        apply_liger_kernel_to_deepseek_v3(model=model)
    assert module_types(model) == kinds and "forward" not in vars(model)


def test_a_refused_instance_call_changes_nothing():
    with class_patches_reverted():
        apply_liger_kernel_to_deepseek_v3(rms_norm=False)
        model = build_model(tiny_deepseek_v3_config())
    apply_liger_kernel_to_deepseek_v3(model=model)  # converts the norms, finds the MLPs built as Liger ones
    assert isinstance(model.model.layers[0].mlp, LigerSwiGLUMLP)
    kinds = module_types(model)
    with pytest.raises(ValueError, match="built as LigerSwiGLUMLP.*nothing was patched"):
        apply_liger_kernel_to_deepseek_v3(rms_norm=False, swiglu=False, model=model)
    assert module_types(model) == kinds  # the norms were not turned back before the refusal


def test_turning_off_the_class_patched_forward_on_an_instance_names_both_functions():
    with class_patches_reverted():
        apply_liger_kernel_to_deepseek_v3()
        model = build_model(tiny_deepseek_v3_config())
        report = apply_liger_kernel_to_deepseek_v3(fused_linear_cross_entropy=False, model=model)
    line = next(r for r in report if r.restored)
    assert (line.old, line.new) == (
        f"{lce_forward.__module__}.{lce_forward.__qualname__}",
        f"{NATIVE_FORWARD.__module__}.{NATIVE_FORWARD.__qualname__}",
    )
    assert model.forward.__func__ is NATIVE_FORWARD


@pytest.mark.parametrize("wrap", ["compile", "peft"])
def test_a_wrapped_model_is_refused_with_the_way_to_its_model(wrap):
    model = build_model(tiny_deepseek_v3_config())
    if wrap == "compile":
        wrapped, hint = torch.compile(model), "patch `model._orig_mod`"
    else:
        peft = pytest.importorskip("peft")
        lora = peft.LoraConfig(r=2, target_modules=["o_proj"])
        wrapped, hint = peft.get_peft_model(model, lora), "patch `model.get_base_model\\(\\)`"
    with pytest.raises(TypeError, match=hint):
        apply_liger_kernel_to_deepseek_v3(model=wrapped)
