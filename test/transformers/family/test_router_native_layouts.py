"""A grouped router whose ``num_experts_per_tok`` exceeds what its kept groups hold (``topk_group`` groups of
``n_routed_experts / n_group`` experts; transformers' own DeepSeek-V3 test config: 8 experts, 2 groups, 1 kept, top-8)
is routed with transformers' own code: natively the top-k is filled with experts of the dropped groups, tied at their
masked score, in ``torch.topk``'s tie order, which the kernel does not reproduce.

Module level: the Liger router returns the native router's logits, weights and indices (same order) and gradients,
exactly. Model level: an instance patch leaves such routers native and reports them, applying the other swaps; a
model built under a class-level patch routes natively with a warning; both give the native loss and gradients (fp32;
the other swaps sum in another order, hence 1e-5).
"""

import copy
import importlib
import logging
import sys
from pathlib import Path

import pytest
import torch
import transformers
from packaging.version import Version

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from liger_dspine import patching  # noqa: E402
from liger_dspine.registry import MODEL_TYPE_TO_APPLY_LIGER_FN  # noqa: E402
from tiny_family import CASES  # noqa: E402
from tiny_models import module_types  # noqa: E402

# Verified on transformers 5.24 and 5.25; the older versions' routers, MoE blocks and outputs differ (to be covered).
NEWER_TRANSFORMERS = pytest.mark.skipif(
    Version(transformers.__version__) < Version("5.24"), reason="checked on transformers >= 5.24 only"
)
pytestmark = [pytest.mark.matrix, NEWER_TRANSFORMERS]

# the grouped routers of the family (the shared-class types, kimi_k25 and mistral3, are covered by their text types)
GROUPED = ["glm4_moe_lite", "axk1", "glm4_moe", "dots1", "deepseek_v2", "deepseek_v32", "glm_moe_dsa", "mistral4"]
TOLERANCE = dict(rtol=1e-5, atol=1e-5)
# (experts, groups, kept groups, top-k): transformers' DeepSeek-V3 test config, then others beyond the kept experts
LAYOUTS = [(8, 2, 1, 8), (8, 2, 1, 5), (12, 3, 1, 7), (20, 4, 2, 11)]


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(patching, "_WARNED_KEPT_NATIVE", set())


def grouping(model_type: str) -> dict:
    return {"topk_method": "group_limited_greedy"} if model_type == "deepseek_v2" else {}


def too_many_experts(config) -> int:
    return config.topk_group * (config.n_routed_experts // config.n_group) + 1


def liger_router_class(case) -> type:
    """The class the model type's spec swaps its router for."""
    spec_module = sys.modules[MODEL_TYPE_TO_APPLY_LIGER_FN[case.model_type].__module__]
    spec = vars(spec_module)[f"{case.model_type.upper()}_SPEC"]
    (swap,) = [s for s in spec.swaps if getattr(s, "names", ())[:1] == (f"{case.prefix}TopkRouter",)]
    return patching.load_object(swap.replacement)


def grouped_router_or_skip(model):
    routers = [module for name, module in model.named_modules() if name.endswith("mlp.gate")]
    if not any(hasattr(router, "num_group") for router in routers):
        pytest.skip("this transformers' router holds no grouping (the MoE block routes)")
    return routers


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: "e{}-g{}-kg{}-k{}".format(*layout))
@pytest.mark.parametrize("model_type", GROUPED)
def test_liger_router_routes_such_layouts_as_native(model_type, layout):
    case = CASES[model_type]
    experts, groups, kept, top_k = layout
    config = case.config(
        n_routed_experts=experts, n_group=groups, topk_group=kept, num_experts_per_tok=top_k, **grouping(model_type)
    )
    native_class = patching.original_global(case.modeling_name, f"{case.prefix}TopkRouter")
    torch.manual_seed(0)
    native = native_class(config).float()
    if not hasattr(native, "num_group"):
        pytest.skip("this transformers' router holds no grouping (the MoE block routes)")
    with torch.no_grad():
        native.weight.normal_(0.0, 0.5)
        if hasattr(native, "e_score_correction_bias"):
            native.e_score_correction_bias.normal_(0.0, 0.1)
    liger = copy.deepcopy(native)
    liger.__class__ = liger_router_class(case)
    assert liger.kept_native_reason(liger).startswith(
        f"num_experts_per_tok={top_k} exceeds the {kept * experts // groups}"
    )

    hidden = torch.randn(12, config.hidden_size, generator=torch.Generator().manual_seed(1))
    ours, ref = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    logits, weights, indices = liger(ours)
    ref_logits, ref_weights, ref_indices = native(ref)
    assert torch.equal(indices, ref_indices)
    assert torch.equal(weights, ref_weights) and torch.equal(logits, ref_logits)
    upstream = torch.randn(weights.shape, generator=torch.Generator().manual_seed(2))
    ((weights * upstream).sum() + logits.sum()).backward()
    ((ref_weights * upstream).sum() + ref_logits.sum()).backward()
    assert torch.equal(ours.grad, ref.grad) and torch.equal(liger.weight.grad, native.weight.grad)


def loss_and_grads(model, input_ids):
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_native_numbers(patched, reference, input_ids):
    """``reference``: the native model's loss and gradients, computed before any class-level patch."""
    loss, grads = loss_and_grads(patched, input_ids)
    ref_loss, ref_grads = reference
    torch.testing.assert_close(loss, ref_loss, **TOLERANCE)
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, **TOLERANCE, msg=lambda m: f"{name}: {m}")


def batch(case):
    return torch.randint(0, case.vocab_size, (2, 8), generator=torch.Generator().manual_seed(3))


def degenerate_model(case):
    top_k = too_many_experts(case.config(**grouping(case.model_type)))
    return case.build(num_experts_per_tok=top_k, **grouping(case.model_type)), top_k


@pytest.mark.parametrize("model_type", GROUPED)
def test_instance_patch_keeps_such_routers_native_and_reports_them(model_type, caplog):
    case = CASES[model_type]
    model, top_k = degenerate_model(case)
    routers = grouped_router_or_skip(model)
    reference = loss_and_grads(model, batch(case))
    before = module_types(model)

    with caplog.at_level(logging.WARNING, logger="liger_dspine"):
        report = case.apply_fn()(model=model)

    assert all(type(router) is before[name] for name, router in model.named_modules() if router in routers)
    assert {k.path for k in report.kept_native} == {n for n, m in model.named_modules() if n.endswith("mlp.gate")}
    assert all(k.reason.startswith(f"num_experts_per_tok={top_k} exceeds the") for k in report.kept_native)
    assert any(r.target.startswith(f"{case.prefix}Experts") for r in report), "the other swaps apply"
    assert [r.getMessage().split(" stays native")[0] for r in caplog.records if "stays native" in r.getMessage()] == [
        f"liger-dspine: {case.prefix}TopkRouter (for {liger_router_class(case).__name__})"
    ]
    assert_native_numbers(model, reference, batch(case))


@pytest.mark.slow  # a model built and run per family member; the instance-level test stays: make test-slow
@pytest.mark.parametrize("model_type", GROUPED)
def test_class_patch_routes_such_layouts_natively(model_type, caplog):
    case = CASES[model_type]
    native, _ = degenerate_model(case)
    grouped_router_or_skip(native)
    reference = loss_and_grads(native, batch(case))
    case.apply_fn()()
    try:
        with caplog.at_level(logging.WARNING, logger="liger_dspine"):
            patched, _ = degenerate_model(case)
        patched.load_state_dict(native.state_dict())
        liger = liger_router_class(case)
        assert all(type(router) is liger for router in grouped_router_or_skip(patched))
        assert any(f"{liger.__name__}'s routing stays native" in r.getMessage() for r in caplog.records)
        assert_native_numbers(patched, reference, batch(case))
    finally:
        case.revert_fn()()


@pytest.mark.parametrize("model_type", ["deepseek_v2", "mistral4"])
def test_the_largest_top_k_the_groups_hold_takes_the_kernel(model_type):
    case = CASES[model_type]
    top_k = too_many_experts(case.config(**grouping(model_type))) - 1
    model = case.build(num_experts_per_tok=top_k, **grouping(model_type))
    grouped_router_or_skip(model)
    report = case.apply_fn()(model=model)
    assert report.kept_native == []
    liger = liger_router_class(case)
    assert all(type(router) is liger for router in grouped_router_or_skip(model))


def test_the_deepseek_v3_test_config_routes_natively():
    """transformers' own DeepSeek-V3 test layout, on the whole model at both levels."""
    from liger_dspine import apply_liger_kernel_to_deepseek_v3
    from liger_dspine import revert_liger_kernel_to_deepseek_v3
    from liger_dspine.models.deepseek_v3.router import LigerDeepseekV3TopkRouter
    from tiny_models import build_model
    from tiny_models import tiny_deepseek_v3_config

    config = tiny_deepseek_v3_config(n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=8)
    native = build_model(config)
    input_ids = torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(3))
    reference = loss_and_grads(native, input_ids)
    modeling = importlib.import_module("transformers.models.deepseek_v3.modeling_deepseek_v3")

    instance = copy.deepcopy(native)
    report = apply_liger_kernel_to_deepseek_v3(model=instance)
    assert [k.path for k in report.kept_native] == ["model.layers.1.mlp.gate"]
    assert type(instance.model.layers[1].mlp.gate) is modeling.DeepseekV3TopkRouter
    assert_native_numbers(instance, reference, input_ids)

    apply_liger_kernel_to_deepseek_v3()
    try:
        patched = build_model(config)
        patched.load_state_dict(native.state_dict())
        assert type(patched.model.layers[1].mlp.gate) is LigerDeepseekV3TopkRouter
        assert_native_numbers(patched, reference, input_ids)
    finally:
        revert_liger_kernel_to_deepseek_v3()
