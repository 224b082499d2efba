"""Param2-MoE builds Glm4MoeForCausalLM: its patch takes GLM-4.5's swaps under its own model type. The table serves a
param2moe model with it, GLM-4.5's function patches such a model the same way, and the two class-level patches share
GLM-4.5's classes: either keeps them until both are reverted, and a call that would undo the other's is refused."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from liger_dspine import apply_liger_kernel_to_glm4_moe  # noqa: E402
from liger_dspine import apply_liger_kernel_to_instance  # noqa: E402
from liger_dspine import apply_liger_kernel_to_param2moe  # noqa: E402
from liger_dspine import revert_liger_kernel_to_glm4_moe  # noqa: E402
from liger_dspine import revert_liger_kernel_to_param2moe  # noqa: E402
from tiny_family import CASES  # noqa: E402

pytestmark = pytest.mark.matrix

CASE = CASES["param2moe"]


def module_types(model) -> dict[str, type]:
    return {name: type(m) for name, m in model.named_modules()}


def test_the_table_and_glm4_moes_function_patch_a_param2moe_model_alike():
    model = CASE.build()
    assert type(model).__name__ == "Glm4MoeForCausalLM" and model.config.model_type == "param2moe"
    assert model.lm_head.weight is model.model.embed_tokens.weight  # Param2's tied head
    other = CASE.build()

    report = apply_liger_kernel_to_instance(model)
    glm_report = apply_liger_kernel_to_glm4_moe(model=other)

    assert report.model_type == "param2moe" and glm_report.model_type == "glm4_moe"
    assert module_types(model) == module_types(other)
    assert {r.target: r.count for r in report} == {r.target: r.count for r in glm_report}


def test_class_patches_of_glm4_moe_and_param2moe_share_the_classes():
    modeling = CASE.modeling_or_skip()
    native_norm = modeling.Glm4MoeRMSNorm
    try:
        apply_liger_kernel_to_glm4_moe()
        report = apply_liger_kernel_to_param2moe()
        assert all(r.already for r in report)
        with pytest.raises(ValueError, match="through the class-level glm4_moe patch, which shares it with param2moe"):
            apply_liger_kernel_to_param2moe(rms_norm=False)
        revert_liger_kernel_to_param2moe()
        assert modeling.Glm4MoeRMSNorm is not native_norm  # glm4_moe still holds it
    finally:
        revert_liger_kernel_to_param2moe()
        revert_liger_kernel_to_glm4_moe()
    assert modeling.Glm4MoeRMSNorm is native_norm
