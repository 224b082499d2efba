"""The fused router in its softmax modes against transformers' routers, over a seeded sweep of layouts.

DeepSeek-V2 (``DeepseekV2TopkRouter``, transformers >= 5.17): softmax, "greedy" or "group_limited_greedy" (groups
scored by their largest score), no renormalisation, no correction bias. Mistral-Small-4 (``Mistral4TopkRouter``, with
``Mistral4MoE.route_tokens_to_experts`` before transformers 5.13): softmax, groups scored by the sum of their two
largest scores, ``norm_topk_prob``. Expert counts, group counts and ``top_k`` are drawn with a fixed seed, powers of
two or not; indices, weights and the gradients of the router weight and of the hidden states are compared in fp32.
Tokens whose group or expert choice is decided by less than ``MARGIN`` (fp64) are dropped first, so that an fp32
rounding cannot flip a near tie.
"""

import importlib
import random
from dataclasses import dataclass

import pytest
import torch

from liger_dspine.ops.moe_router import liger_moe_router_topk

pytestmark = pytest.mark.matrix

MARGIN = 1e-5
HIDDEN = 8


@dataclass(frozen=True)
class Layout:
    model: str  # "deepseek_v2" or "mistral4"
    num_experts: int
    n_group: int
    topk_group: int
    top_k: int
    topk_method: str = "group_limited_greedy"  # DeepSeek-V2 only
    norm_topk_prob: bool = True  # Mistral-Small-4 only
    routed_scaling_factor: float = 1.0

    @property
    def grouped(self) -> bool:
        return self.model == "mistral4" or self.topk_method == "group_limited_greedy"

    @property
    def group_size(self) -> int:
        return self.num_experts // self.n_group


NAMED = [
    Layout("deepseek_v2", 160, 8, 3, 6, routed_scaling_factor=16.0),  # DeepSeek-V2 / V2.5
    Layout("deepseek_v2", 64, 1, 1, 6, topk_method="greedy"),  # DeepSeek-V2-Lite
    Layout("deepseek_v2", 6, 3, 2, 2),  # groups of 2
    Layout("deepseek_v2", 20, 4, 2, 4, routed_scaling_factor=2.5),  # groups of 5
    Layout("deepseek_v2", 21, 7, 7, 21),  # every expert chosen
    Layout("mistral4", 128, 1, 1, 4),  # Mistral-Small-4
    Layout("mistral4", 12, 3, 1, 3, norm_topk_prob=False, routed_scaling_factor=2.0),
    Layout("mistral4", 30, 5, 2, 5),  # groups of 6
]


def random_layouts(count: int, seed: int = 2025) -> list[Layout]:
    rng = random.Random(seed)
    layouts = []
    for index in range(count):
        model = ("deepseek_v2", "mistral4")[index % 2]
        group_size = rng.choice([2, 3, 5, 6, 7, 9, 12, 16, 20])
        n_group = rng.choice([1, 2, 3, 5, 6, 8])
        topk_group = rng.randint(1, n_group)
        layouts.append(
            Layout(
                model,
                group_size * n_group,
                n_group,
                topk_group,
                rng.randint(1, min(topk_group * group_size, 8)),
                topk_method=rng.choice(["greedy", "group_limited_greedy"]),
                norm_topk_prob=rng.random() < 0.6,
                routed_scaling_factor=rng.choice([1.0, 2.5, round(rng.uniform(0.5, 4.0), 3)]),
            )
        )
    return layouts


SWEEP = NAMED + random_layouts(20)


def layout_id(layout: Layout) -> str:
    method = layout.topk_method if layout.model == "deepseek_v2" else ("norm" if layout.norm_topk_prob else "nonorm")
    return f"{layout.model}-e{layout.num_experts}-g{layout.n_group}-kg{layout.topk_group}-k{layout.top_k}-{method}"


def native_router(layout: Layout, seed: int):
    """transformers' router class of the model, or a skip where this transformers has none."""
    try:
        modeling = importlib.import_module(f"transformers.models.{layout.model}.modeling_{layout.model}")
    except ModuleNotFoundError:
        pytest.skip(f"this transformers has no {layout.model}")
    prefix = {"deepseek_v2": "DeepseekV2", "mistral4": "Mistral4"}[layout.model]
    router_class = getattr(modeling, f"{prefix}TopkRouter", None)
    if router_class is None:
        pytest.skip(f"this transformers routes {layout.model} in its MoE block (no router class)")
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        layout.model,
        hidden_size=HIDDEN,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_routed_experts=layout.num_experts,
        num_experts_per_tok=layout.top_k,
        n_group=layout.n_group,
        topk_group=layout.topk_group,
        topk_method=layout.topk_method,
        norm_topk_prob=layout.norm_topk_prob,
        routed_scaling_factor=layout.routed_scaling_factor,
    )
    torch.manual_seed(seed)
    router = router_class(config).float()
    with torch.no_grad():
        router.weight.normal_(0.0, 0.5)
    if not hasattr(router, "num_group"):
        # transformers < 5.13 (Mistral-Small-4): the router returns only the logits, the MoE block selects
        config.moe_intermediate_size = config.intermediate_size = 4
        return BlockRouting(getattr(modeling, f"{prefix}MoE")(config).float(), router)
    return router


class BlockRouting:
    """A router returning only the logits and its MoE block's ``route_tokens_to_experts``, as the router of
    transformers >= 5.13: ``(router_logits, topk_weights, topk_indices)``."""

    def __init__(self, block, router):
        self.block = block
        self.router = router
        self.weight = router.weight

    def __call__(self, hidden):
        router_logits = self.router(hidden)
        topk_indices, topk_weights = self.block.route_tokens_to_experts(router_logits)
        return router_logits, topk_weights, topk_indices


def liger_routing(router, layout: Layout, hidden: torch.Tensor):
    """The kernel on the native router's weight, as the Liger routers call it."""
    logits = torch.nn.functional.linear(hidden, router.weight)
    if layout.model == "deepseek_v2" and layout.topk_method == "greedy":
        groups = dict(n_group=1, topk_group=1)
    else:
        groups = dict(n_group=layout.n_group, topk_group=layout.topk_group)
    return liger_moe_router_topk(
        logits,
        None,
        top_k=layout.top_k,
        norm_topk_prob=layout.model == "mistral4" and layout.norm_topk_prob,
        routed_scaling_factor=layout.routed_scaling_factor,
        score_func="softmax",
        group_score="max" if layout.model == "deepseek_v2" else "top2",
        **groups,
    )


def decisive(logits: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Tokens whose kept groups and chosen experts each win by at least ``MARGIN`` (fp64)."""
    scores = logits.double().softmax(dim=-1)
    ok = torch.ones(logits.shape[0], dtype=torch.bool)
    if layout.grouped and layout.topk_group < layout.n_group:
        grouped = scores.view(-1, layout.n_group, layout.group_size)
        if layout.model == "deepseek_v2":
            group_scores = grouped.max(dim=-1).values
        else:
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        ranked, order = group_scores.sort(dim=-1, descending=True)
        ok &= ranked[:, layout.topk_group - 1] - ranked[:, layout.topk_group] >= MARGIN
        kept = torch.zeros_like(group_scores).scatter_(1, order[:, : layout.topk_group], 1).bool()
        scores = scores.masked_fill(~kept.repeat_interleave(layout.group_size, dim=1), float("-inf"))
    candidates = layout.topk_group * layout.group_size if layout.grouped else layout.num_experts
    if layout.top_k < candidates:
        ranked = scores.sort(dim=-1, descending=True)[0]
        ok &= ranked[:, layout.top_k - 1] - ranked[:, layout.top_k] >= MARGIN
    return ok


def by_index(weights: torch.Tensor, indices: torch.Tensor):
    sorted_indices, order = indices.sort(dim=-1)
    return weights.gather(1, order), sorted_indices


@pytest.mark.parametrize("seed,layout", list(enumerate(SWEEP)), ids=[layout_id(layout) for layout in SWEEP])
def test_softmax_routing_sweep_matches_native(seed, layout):
    native = native_router(layout, seed)
    hidden = torch.randn(32, HIDDEN, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        keep = decisive(torch.nn.functional.linear(hidden, native.weight), layout)
    assert keep.sum() >= 12, "too many near ties: the comparison would be vacuous"
    hidden = hidden[keep]

    hidden_ours = hidden.clone().requires_grad_()
    hidden_ref = hidden.clone().requires_grad_()
    weight_ours = native.weight.detach().clone().requires_grad_()
    weights, indices = liger_routing(type("Router", (), {"weight": weight_ours}), layout, hidden_ours)
    _, ref_weights, ref_indices = native(hidden_ref)

    assert weights.dtype == torch.float32 and indices.dtype == torch.int64
    assert weights.shape == indices.shape == (hidden.shape[0], layout.top_k)
    w, i = by_index(weights.detach(), indices)
    ref_w, ref_i = by_index(ref_weights.detach(), ref_indices)
    torch.testing.assert_close(i, ref_i, rtol=0, atol=0)
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-7)

    # One upstream gradient per (token, expert); the softmax spreads it over every expert of the row.
    upstream = torch.randn(hidden.shape[0], layout.num_experts, generator=torch.Generator().manual_seed(seed + 1))
    (weights * upstream.gather(1, indices)).sum().backward()
    (ref_weights * upstream.gather(1, ref_indices)).sum().backward()
    # each entry sums a softmax gradient over the experts, which cancels: the tolerance is relative to the scale
    for ours, ref in ((hidden_ours.grad, hidden_ref.grad), (weight_ours.grad, native.weight.grad)):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_sweep_covers_layouts_that_are_not_powers_of_two():
    grouped = [layout for layout in SWEEP if layout.grouped and layout.n_group > 1]
    assert len(SWEEP) == 28
    assert sum(1 for layout in grouped if layout.group_size & (layout.group_size - 1)) >= 8
    assert sum(1 for layout in grouped if layout.n_group & (layout.n_group - 1)) >= 5
    assert {layout.topk_method for layout in SWEEP if layout.model == "deepseek_v2"} == {
        "greedy",
        "group_limited_greedy",
    }
    assert any(not layout.norm_topk_prob for layout in SWEEP if layout.model == "mistral4")


def test_a_nan_logit_makes_its_row_nan_as_native():
    """Softmax: one NaN logit makes the whole row's scores, weights and gradients NaN, natively and here."""
    logits = torch.randn(3, 12, generator=torch.Generator().manual_seed(0))
    logits[1, 4] = float("nan")
    ours = logits.clone().requires_grad_()
    weights, indices = liger_moe_router_topk(
        ours, None, top_k=2, n_group=3, topk_group=1, norm_topk_prob=False, score_func="softmax", group_score="max"
    )
    assert weights[1].isnan().all() and not weights[[0, 2]].isnan().any()
    weights.sum().backward()
    ref = logits.clone().requires_grad_()
    ref.softmax(dim=-1).gather(1, indices).sum().backward()  # native's gradient for the same choice
    assert ours.grad[1].isnan().all() and ref.grad[1].isnan().all()
    torch.testing.assert_close(ours.grad[[0, 2]], ref.grad[[0, 2]], rtol=1e-5, atol=1e-7)


def test_refused_modes():
    logits = torch.randn(2, 6)
    with pytest.raises(ValueError, match="liger-dspine: score_func must be one of"):
        liger_moe_router_topk(logits, None, top_k=2, n_group=1, topk_group=1, score_func="relu")
    with pytest.raises(ValueError, match="liger-dspine: group_score must be one of"):
        liger_moe_router_topk(logits, None, top_k=2, n_group=1, topk_group=1, group_score="sum")
    # a group of one expert has no second score to add, but its largest is its score
    with pytest.raises(ValueError, match="liger-dspine: each group needs at least 2 experts"):
        liger_moe_router_topk(logits, None, top_k=2, n_group=6, topk_group=2, score_func="softmax")
    weights, indices = liger_moe_router_topk(
        logits, None, top_k=2, n_group=6, topk_group=2, norm_topk_prob=False, score_func="softmax", group_score="max"
    )
    ref_weights, ref_indices = logits.softmax(-1).topk(2, dim=-1)
    torch.testing.assert_close(by_index(weights, indices), by_index(ref_weights, ref_indices))
