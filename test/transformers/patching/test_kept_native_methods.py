"""The routing method swaps of the transformers versions whose MoE block routes (``route_tokens_to_experts``: before
5.13, and before 5.17 for DeepSeek-V2), on a stand-in modeling module: a grouping whose top-k exceeds the kept groups
runs the block's own method (class level: the replacement calls the original; instance level: nothing is bound and
the report says why), any other takes the kernel."""

import sys
import types

import pytest
import torch
from torch import nn

from liger_dspine import patching
from liger_dspine.models.deepseek_v2.router import liger_deepseek_v2_route_tokens_to_experts
from liger_dspine.models.deepseek_v2.router import liger_top2_route_tokens_to_experts
from liger_dspine.models.deepseek_v3.router import liger_route_tokens_to_experts

MODULE = "liger_dspine_test_block_routing"
EXPERTS, HIDDEN = 8, 4  # 2 groups of 4, 1 kept: a top-k above 4 takes experts of the dropped group natively

# replacement -> the MoE block attributes its transformers layout holds, given top_k
LAYOUTS = {
    liger_route_tokens_to_experts: lambda k: dict(
        top_k=k, n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0
    ),
    liger_deepseek_v2_route_tokens_to_experts: lambda k: dict(
        top_k=k, num_group=2, topk_group=1, topk_method="group_limited_greedy", routed_scaling_factor=1.0
    ),
    liger_top2_route_tokens_to_experts: lambda k: dict(
        top_k=k, n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0
    ),
}


class StandInMoE(nn.Module):
    def __init__(self, top_k: int, layout):
        super().__init__()
        self.gate = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.gate.register_buffer("e_score_correction_bias", torch.zeros(EXPERTS))
        for name, value in layout(top_k).items():
            setattr(self, name, value)

    def route_tokens_to_experts(self, router_logits):
        return "native", router_logits


class StandInModel(nn.Module):
    def __init__(self, top_k: int, layout):
        super().__init__()
        self.mlp = StandInMoE(top_k, layout)


@pytest.fixture
def spec(request, monkeypatch):
    replacement = request.param
    module = types.ModuleType(MODULE)
    module.StandInMoE, module.StandInModel = StandInMoE, StandInModel
    StandInMoE.__module__ = StandInModel.__module__ = MODULE
    monkeypatch.setitem(sys.modules, MODULE, module)
    monkeypatch.setattr(patching, "_WARNED_KEPT_NATIVE", set())
    path = f"{replacement.__module__}:{replacement.__name__}"
    swap = patching.MethodSwap("moe_router", "StandInMoE", "route_tokens_to_experts", path)
    spec = patching.PatchSpec("stand_in", MODULE, (f"{MODULE}:StandInModel",), (swap,))
    yield spec, LAYOUTS[replacement]
    patching.revert_class_level(spec)


REPLACEMENTS = list(LAYOUTS)
IDS = ["deepseek_v3", "deepseek_v2", "mistral4"]


@pytest.mark.parametrize("spec", REPLACEMENTS, ids=IDS, indirect=True)
def test_class_level_calls_the_original_method_for_such_a_grouping(spec, caplog):
    spec, layout = spec
    patching.apply_class_level(spec, {"moe_router": True})
    logits = torch.randn(3, EXPERTS, generator=torch.Generator().manual_seed(0))

    with caplog.at_level("WARNING", logger="liger_dspine"):
        assert StandInMoE(5, layout).route_tokens_to_experts(logits)[0] == "native"
    assert "StandInMoE.route_tokens_to_experts stays native" in caplog.text
    assert "num_experts_per_tok=5 exceeds the 4 experts of the topk_group=1 kept group(s)" in caplog.text

    indices, weights = StandInMoE(4, layout).route_tokens_to_experts(logits)  # the kept groups hold 4: the kernel
    assert indices.shape == weights.shape == (3, 4)
    assert (indices.div(4, rounding_mode="floor") == indices[:, :1].div(4, rounding_mode="floor")).all()


@pytest.mark.parametrize("spec", REPLACEMENTS, ids=IDS, indirect=True)
def test_instance_level_binds_nothing_for_such_a_grouping(spec):
    spec, layout = spec
    model = StandInModel(5, layout)
    report = patching.apply_to_instance(spec, {"moe_router": True}, model)
    assert "route_tokens_to_experts" not in vars(model.mlp)
    (kept,) = report.kept_native
    assert (kept.path, kept.native) == ("mlp", "StandInMoE.route_tokens_to_experts")
    assert kept.reason.startswith("num_experts_per_tok=5 exceeds the 4 experts")
    assert report.replacements == []

    model = StandInModel(4, layout)
    report = patching.apply_to_instance(spec, {"moe_router": True}, model)
    assert vars(model.mlp)["route_tokens_to_experts"].__func__ is patching.load_object(spec.swaps[0].replacement)
    assert report.kept_native == [] and [r.count for r in report] == [1]
