"""A grouped router whose ``num_experts_per_tok`` exceeds what its groups hold (``topk_group`` groups of
``n_routed_experts / n_group`` experts) is refused by an instance patch before anything changes: natively such a
router fills the top-k with experts of masked-out groups, which the kernel does not reproduce."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from liger_dspine import apply_liger_kernel_to_deepseek_v3  # noqa: E402
from tiny_family import CASES  # noqa: E402
from tiny_models import build_model  # noqa: E402
from tiny_models import module_types  # noqa: E402
from tiny_models import tiny_deepseek_v3_config  # noqa: E402

# the grouped routers of the family (the shared-class types, kimi_k25 and mistral3, are covered by their text types)
GROUPED = ["glm4_moe_lite", "axk1", "glm4_moe", "dots1", "deepseek_v2", "deepseek_v32", "glm_moe_dsa", "mistral4"]


def too_many_experts(config) -> int:
    return config.topk_group * (config.n_routed_experts // config.n_group) + 1


def routers(model) -> list:
    return [module for name, module in model.named_modules() if name.endswith("mlp.gate")]


def assert_refused_unchanged(model, apply, top_k: int) -> None:
    if not any(hasattr(router, "num_group") for router in routers(model)):
        pytest.skip("this transformers' router holds no grouping (the MoE block routes); the kernel refuses per call")
    before = module_types(model)
    with pytest.raises(ValueError, match=f"liger-dspine: num_experts_per_tok={top_k} must be in"):
        apply(model=model)
    assert module_types(model) == before


def test_deepseek_v3():
    config = tiny_deepseek_v3_config()
    top_k = too_many_experts(config)
    model = build_model(tiny_deepseek_v3_config(num_experts_per_tok=top_k))
    assert_refused_unchanged(model, apply_liger_kernel_to_deepseek_v3, top_k)


@pytest.mark.parametrize("model_type", GROUPED)
def test_family(model_type):
    case = CASES[model_type]
    grouping = {"topk_method": "group_limited_greedy"} if model_type == "deepseek_v2" else {}
    top_k = too_many_experts(case.config(**grouping))
    model = case.build(num_experts_per_tok=top_k, **grouping)
    assert_refused_unchanged(model, case.apply_fn(), top_k)


@pytest.mark.parametrize("model_type", ["deepseek_v2", "mistral4"])
def test_the_largest_top_k_the_groups_hold_is_accepted(model_type):
    case = CASES[model_type]
    grouping = {"topk_method": "group_limited_greedy"} if model_type == "deepseek_v2" else {}
    top_k = too_many_experts(case.config(**grouping)) - 1
    model = case.build(num_experts_per_tok=top_k, **grouping)
    before = module_types(model)
    case.apply_fn()(model=model)
    changed = {path for path, kind in module_types(model).items() if kind is not before[path]}
    assert any(path.endswith("mlp.experts") for path in changed), changed
