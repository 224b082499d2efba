"""The SwiGLU MLP and experts replacements refuse what they would compute differently: a clamped SwiGLU
(``swiglu_limit`` / ``limit``, as DeepSeek-V4 and GLM-5.3 have), a subclass with a forward of its own. At
construction (class level) and before an instance patch changes anything. An activation other than SiLU is refused
when a Liger module is built directly; a patch keeps such modules native (``test_unfused_activation.py``)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from liger_dspine import apply_liger_kernel_to_deepseek_v3  # noqa: E402
from liger_dspine.modules.experts import LigerFusedExperts  # noqa: E402
from liger_dspine.modules.grouped_experts import LigerGroupedExperts  # noqa: E402
from liger_dspine.modules.swiglu import LigerSwiGLUMLP  # noqa: E402
from tiny_family import CASES  # noqa: E402
from tiny_models import build_model  # noqa: E402
from tiny_models import modeling_module  # noqa: E402
from tiny_models import module_types  # noqa: E402
from tiny_models import native_experts_class  # noqa: E402
from tiny_models import tiny_deepseek_v3_config  # noqa: E402

pytestmark = pytest.mark.matrix

REPLACEMENTS = [LigerSwiGLUMLP, LigerGroupedExperts, LigerFusedExperts]


def clamped_config(field: str):
    config = tiny_deepseek_v3_config()
    setattr(config, field, 7.0)
    return config


@pytest.mark.parametrize("field", ["swiglu_limit", "limit"])
@pytest.mark.parametrize("replacement", REPLACEMENTS, ids=lambda c: c.__name__)
def test_construction_refuses_a_clamped_config(replacement, field):
    with pytest.raises(ValueError, match=f"liger-dspine: {replacement.__name__} .* config has {field}=7.0"):
        replacement(clamped_config(field))


@pytest.mark.parametrize("replacement", REPLACEMENTS, ids=lambda c: c.__name__)
def test_construction_refuses_another_activation(replacement):
    with pytest.raises(ValueError, match=f"liger-dspine: {replacement.__name__} fuses SiLU only.*'gelu'"):
        replacement(tiny_deepseek_v3_config(hidden_act="gelu"))


def assert_refused_unchanged(model, match: str, **options) -> None:
    before = module_types(model)
    with pytest.raises(ValueError, match=match):
        apply_liger_kernel_to_deepseek_v3(model=model, **options)
    assert module_types(model) == before and "forward" not in vars(model)


@pytest.mark.parametrize("field", ["swiglu_limit", "limit"])
def test_instance_patch_refuses_a_clamped_config(field):
    model = build_model(tiny_deepseek_v3_config())
    setattr(model.config, field, 7.0)  # every module holds this config
    assert_refused_unchanged(
        model, f"LigerSwiGLUMLP computes silu\\(gate\\) \\* up without a clamp; config has {field}"
    )


def test_instance_patch_refuses_a_module_that_clamps():
    model = build_model(tiny_deepseek_v3_config())
    model.model.layers[1].mlp.shared_experts.limit = 7.0
    assert_refused_unchanged(model, "LigerSwiGLUMLP .* this module has limit=7.0")


@pytest.mark.parametrize("options", [{}, {"fused_experts": True}], ids=["grouped", "fused"])
def test_instance_patch_keeps_experts_with_another_activation_native(options):
    """Their own act_fn (the config says SiLU): the experts stay as they are, the report and a warning say why."""
    model = build_model(tiny_deepseek_v3_config())
    experts = model.model.layers[1].mlp.experts
    experts.act_fn = torch.nn.GELU()
    report = apply_liger_kernel_to_deepseek_v3(model=model, **options)
    assert type(experts) is native_experts_class()
    (kept,) = report.kept_native
    assert kept.path == "model.layers.1.mlp.experts"
    assert kept.replacement == ("LigerFusedExperts" if options else "LigerGroupedExperts")
    assert kept.reason == "its act_fn is GELU, and the kernel fuses SiLU only"
    assert type(model.model.layers[1].mlp.shared_experts) is LigerSwiGLUMLP


def test_instance_patch_refuses_a_subclass_with_its_own_gate_function():
    """As Beam's MLP: the same layout, the activation computed another way."""
    native_mlp = modeling_module().DeepseekV3MLP

    class FloatGateMLP(native_mlp):
        def forward(self, x):
            gate = self.act_fn(self.gate_proj(x).float()) * self.up_proj(x).float()
            return self.down_proj(gate.to(x.dtype))

    model = build_model(tiny_deepseek_v3_config())
    model.model.layers[0].mlp.__class__ = FloatGateMLP
    assert_refused_unchanged(model, "model.layers.0.mlp is a FloatGateMLP, a subclass of DeepseekV3MLP with a forward")


def test_a_family_model_with_a_clamp_is_refused():
    case = CASES["glm4_moe_lite"]
    model = case.build()
    model.config.swiglu_limit = 10.0
    before = {name: type(m) for name, m in model.named_modules()}
    with pytest.raises(ValueError, match="config has swiglu_limit=10.0"):
        case.apply_fn()(model=model)
    assert {name: type(m) for name, m in model.named_modules()} == before


def test_native_experts_class_is_accepted_unchanged():
    """The check reads the native experts' own act_fn: SiLU there, so the default patch converts them."""
    model = build_model(tiny_deepseek_v3_config())
    apply_liger_kernel_to_deepseek_v3(model=model)
    assert not any(type(m) is native_experts_class() for m in model.modules())


def test_biased_mlps_are_refused_at_both_levels():
    """DeepSeek-V2's MLP (Llama's) takes ``mlp_bias``: LigerSwiGLUMLP has no biases, so it refuses them."""
    case = CASES["deepseek_v2"]
    case.modeling_or_skip()
    with pytest.raises(ValueError, match="liger-dspine: LigerSwiGLUMLP has no projection biases; config has mlp_bias"):
        LigerSwiGLUMLP(case.config(mlp_bias=True))
    model = case.build(mlp_bias=True)
    before = module_types(model)
    with pytest.raises(ValueError, match="liger-dspine: LigerSwiGLUMLP has no projection biases; this MLP's gate_proj"):
        case.apply_fn()(model=model)
    assert module_types(model) == before and "forward" not in vars(model)
