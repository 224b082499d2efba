"""The engine's rule for applying again: the latest call describes the model, at class level and on an instance;
the instance revert; at most one enabled swap per target. DeepSeek-V3 and DSpine patches alike."""

import pytest
import torch
from transformers.models.deepseek_v3 import modeling_deepseek_v3
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from liger_dspine import apply_liger_kernel_to_deepseek_v3
from liger_dspine import apply_liger_kernel_to_dspine
from liger_dspine import patching
from liger_dspine import revert_liger_kernel_to_deepseek_v3
from liger_dspine import revert_liger_kernel_to_dspine
from liger_dspine.models.deepseek_v3.attention import LigerDeepseekV3Attention
from liger_dspine.models.deepseek_v3.attention import LigerDeepseekV3RecomputeAttention
from liger_dspine.models.dspine import DSpineDraftModel
from liger_dspine.models.dspine import DSpineObjective
from liger_dspine.models.dspine import builders
from liger_dspine.modules.rms_norm import LigerRMSNorm
from tiny_dspine import tiny_draft_config
from tiny_dspine import tiny_target
from tiny_models import build_model
from tiny_models import class_patches_reverted
from tiny_models import loss_and_grads
from tiny_models import module_types
from tiny_models import random_batch
from tiny_models import tiny_deepseek_v3_config

class_level_deepseek_v3 = class_patches_reverted


@pytest.fixture
def dspine_class_level():
    yield
    revert_liger_kernel_to_dspine()
    assert builders.Qwen3RMSNorm is Qwen3RMSNorm


def objective(target, fused_objective=None):
    torch.manual_seed(0)
    draft = DSpineDraftModel(tiny_draft_config())
    return DSpineObjective(draft, target.lm_head, target.model.embed_tokens, fused_objective=fused_objective)


def test_class_level_latest_call_switches_the_fused_objective_back(dspine_class_level):
    target = tiny_target()
    built = objective(target)
    apply_liger_kernel_to_dspine()
    assert built.fused_objective and builders.Qwen3RMSNorm is LigerRMSNorm
    report = apply_liger_kernel_to_dspine(rms_norm=False, fused_objective=False)
    assert not built.fused_objective and not objective(target).fused_objective
    assert builders.Qwen3RMSNorm is Qwen3RMSNorm
    restored = [r.target for r in report if r.restored]
    assert restored == [
        "liger_dspine.models.dspine.builders.Qwen3RMSNorm",
        "liger_dspine.models.dspine.objective.DSpineObjective.patched_fused_objective",
    ]
    assert "(restored: option off)" in str(report)
    assert objective(target, fused_objective=True).fused_objective  # an explicit choice still wins


def test_instance_latest_call_and_revert():
    target = tiny_target()
    patched, native = objective(target), objective(target)
    state = {k: v.clone() for k, v in patched.state_dict().items()}
    apply_liger_kernel_to_dspine(model=patched)
    assert patched.fused_objective and isinstance(patched.draft_model.norm, LigerRMSNorm)
    apply_liger_kernel_to_dspine(rms_norm=False, fused_objective=False, model=patched)
    assert not patched.fused_objective and type(patched.draft_model.norm) is Qwen3RMSNorm
    assert type(patched.draft_model.layers[0].mlp) is not type(native.draft_model.layers[0].mlp)  # swiglu stays
    restored = revert_liger_kernel_to_dspine(model=patched)
    assert restored == ["LigerSwiGLUMLP modules", "LigerDSpineAttention modules", "LigerAdjacentInjection modules"]
    assert {n: type(m) for n, m in patched.named_modules()} == {n: type(m) for n, m in native.named_modules()}
    assert all(torch.equal(patched.state_dict()[k], v) for k, v in state.items())
    assert revert_liger_kernel_to_dspine(model=patched) == []


def test_deepseek_v3_instance_revert_gives_native_numbers():
    config = tiny_deepseek_v3_config()
    native, patched = build_model(config), build_model(config)
    input_ids, labels = random_batch(config)
    apply_liger_kernel_to_deepseek_v3(model=patched)
    assert module_types(patched) != module_types(native) and "forward" in vars(patched)
    revert_liger_kernel_to_deepseek_v3(model=patched)
    assert module_types(patched) == module_types(native) and "forward" not in vars(patched)
    (out, grads), (ref, ref_grads) = (loss_and_grads(m, input_ids, labels=labels) for m in (patched, native))
    assert out.logits is not None  # the native forward again
    torch.testing.assert_close(out.loss, ref.loss, atol=0, rtol=0)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=0, rtol=0, msg=name)


def test_deepseek_v3_default_after_recompute_attention_takes_the_default_attention():
    config = tiny_deepseek_v3_config()
    model = build_model(config)
    apply_liger_kernel_to_deepseek_v3(recompute_attention=True, model=model)
    assert any(type(m) is LigerDeepseekV3RecomputeAttention for m in model.modules())
    apply_liger_kernel_to_deepseek_v3(model=model)
    kinds = {type(m) for m in model.modules()}
    assert LigerDeepseekV3Attention in kinds and LigerDeepseekV3RecomputeAttention not in kinds
    with class_level_deepseek_v3():
        apply_liger_kernel_to_deepseek_v3(recompute_attention=True)
        assert modeling_deepseek_v3.DeepseekV3Attention is LigerDeepseekV3RecomputeAttention
        apply_liger_kernel_to_deepseek_v3()
        assert modeling_deepseek_v3.DeepseekV3Attention is LigerDeepseekV3Attention
        apply_liger_kernel_to_deepseek_v3(rope=False, rms_norm=False)
        assert modeling_deepseek_v3.DeepseekV3Attention.__module__ == modeling_deepseek_v3.__name__
        assert modeling_deepseek_v3.DeepseekV3RMSNorm.__module__ == modeling_deepseek_v3.__name__


def test_deepseek_v3_recompute_attention_after_a_default_instance_patch_takes_it_with_the_native_loss():
    config = tiny_deepseek_v3_config()
    input_ids, labels = random_batch(config)
    native = build_model(config)
    ref, ref_grads = loss_and_grads(native, input_ids, labels=labels)
    model = build_model(config)
    apply_liger_kernel_to_deepseek_v3(model=model)
    report = apply_liger_kernel_to_deepseek_v3(recompute_attention=True, model=model)
    assert [r.target for r in report if r.restored] == ["LigerDeepseekV3Attention modules"]
    kinds = {type(m) for m in model.modules()}
    assert LigerDeepseekV3RecomputeAttention in kinds and LigerDeepseekV3Attention not in kinds
    out, grads = loss_and_grads(model, input_ids, labels=labels)
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-6, rtol=1e-5)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_a_module_built_under_the_class_patch_cannot_be_turned_back(dspine_class_level):
    target = tiny_target()
    apply_liger_kernel_to_dspine()
    built = objective(target)
    with pytest.raises(ValueError, match="was built as LigerRMSNorm .* revert the class-level patch"):
        apply_liger_kernel_to_dspine(rms_norm=False, model=built)


def test_two_enabled_swaps_on_one_target_are_refused():
    swaps = (
        patching.ClassSwap("a", ("Qwen3RMSNorm",), "liger_dspine.modules.rms_norm:LigerRMSNorm"),
        patching.ClassSwap("b", ("Qwen3RMSNorm",), "liger_dspine.modules.rms_norm:LigerRMSNorm"),
    )
    spec = patching.PatchSpec("toy", "liger_dspine.models.dspine.builders", (), swaps)
    with pytest.raises(ValueError, match="options 'a' and 'b' of the toy patch both replace"):
        patching.apply_class_level(spec, {"a": True, "b": True})
    assert builders.Qwen3RMSNorm is Qwen3RMSNorm  # refused before anything changed
    assert patching.apply_class_level(spec, {"a": False, "b": False}).replacements == []


def test_instance_opt_out_of_a_class_patched_forward_pickles():
    import pickle

    config = tiny_deepseek_v3_config()
    input_ids, labels = random_batch(config)
    with class_level_deepseek_v3():
        apply_liger_kernel_to_deepseek_v3()
        model = build_model(config).train()
        apply_liger_kernel_to_deepseek_v3(fused_linear_cross_entropy=False, model=model)
        assert model(input_ids, labels=labels).logits is not None  # the native forward on this instance
        loaded = pickle.loads(pickle.dumps(model))
        assert loaded.forward.__func__ is model.forward.__func__
        out, ref = loaded(input_ids, labels=labels), model(input_ids, labels=labels)
        assert out.logits is not None
        torch.testing.assert_close(out.loss, ref.loss, atol=0, rtol=0)
