"""The fused router against transformers' DeepSeek-V3 routing over many layouts, exact ties and rows holding NaN.

The sweep draws layouts (expert count, ``n_group``, ``topk_group``, ``top_k``, ``norm_topk_prob``,
``routed_scaling_factor``, a non-zero correction bias) with a fixed seed, powers of two or not, and compares the
indices, the weights and the gradients of the router weight and of the hidden states with the native router
(``DeepseekV3TopkRouter``, or ``DeepseekV3MoE.route_tokens_to_experts`` before transformers 5.13), in fp32.
Tokens whose group or expert choice is decided by less than ``MARGIN`` (fp64) are dropped before routing, so that
every gradient, summed over tokens, can be compared: an fp32 rounding of the sigmoid may flip a near tie.
"""

import random
import types
from dataclasses import dataclass

import pytest
import torch
import transformers
from packaging.version import Version
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from liger_dspine.models.deepseek_v3.router import LigerDeepseekV3TopkRouter
from liger_dspine.models.deepseek_v3.router import liger_route_tokens_to_experts
from liger_dspine.ops.moe_router import liger_moe_router_topk
from liger_dspine.ops.moe_router import masked_topk_reason
from tiny_models import tiny_router_config

pytestmark = pytest.mark.matrix

MARGIN = 1e-5
HIDDEN = 8
NAN = float("nan")


@dataclass(frozen=True)
class Layout:
    num_experts: int
    n_group: int
    topk_group: int
    top_k: int
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    bias_scale: float = 0.1
    bias_offset: float = 0.0  # a negative one makes every biased score negative

    @property
    def group_size(self) -> int:
        return self.num_experts // self.n_group

    def kwargs(self) -> dict:
        return dict(
            top_k=self.top_k,
            n_group=self.n_group,
            topk_group=self.topk_group,
            norm_topk_prob=self.norm_topk_prob,
            routed_scaling_factor=self.routed_scaling_factor,
        )


NAMED = [
    Layout(6, 2, 1, 2),  # groups of 3
    Layout(20, 4, 2, 4, routed_scaling_factor=2.5),  # groups of 5
    Layout(160, 8, 3, 6, routed_scaling_factor=16.0),  # DeepSeek-V2
    Layout(256, 8, 4, 8, routed_scaling_factor=2.5, bias_offset=4.0),  # DeepSeek-V3
    Layout(384, 1, 1, 8, routed_scaling_factor=2.827),  # Kimi-K2: one group of 384
    Layout(12, 3, 3, 12, norm_topk_prob=False),  # every kept expert chosen
    Layout(10, 5, 1, 1, bias_offset=-3.0),
    Layout(8, 2, 1, 2),
]


def random_layouts(count: int, seed: int = 2024) -> list[Layout]:
    rng = random.Random(seed)
    layouts = []
    for _ in range(count):
        group_size = rng.choice([2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 20, 24, 32])
        n_group = rng.choice([1, 2, 3, 4, 5, 6, 7, 8])
        topk_group = rng.randint(1, n_group)
        top_k = rng.randint(1, min(topk_group * group_size, 12))
        layouts.append(
            Layout(
                group_size * n_group,
                n_group,
                topk_group,
                top_k,
                norm_topk_prob=rng.random() < 0.7,
                routed_scaling_factor=rng.choice([1.0, 2.5, round(rng.uniform(0.5, 4.0), 3)]),
                bias_scale=rng.choice([0.01, 0.1, 1.0]),
                bias_offset=rng.choice([0.0, 0.0, 3.0, -2.0]),
            )
        )
    return layouts


SWEEP = NAMED + random_layouts(40)


def layout_id(layout: Layout) -> str:
    norm = "" if layout.norm_topk_prob else "-nonorm"
    return f"e{layout.num_experts}-g{layout.n_group}-kg{layout.topk_group}-k{layout.top_k}{norm}"


def decisive(logits: torch.Tensor, bias: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Tokens whose kept groups and chosen experts each win by at least ``MARGIN`` (fp64)."""
    choice = logits.double().sigmoid() + bias.double()
    group_scores = choice.view(-1, layout.n_group, layout.group_size).topk(2, dim=-1)[0].sum(dim=-1)
    ranked_groups, group_order = group_scores.sort(dim=-1, descending=True)
    ok = torch.ones(logits.shape[0], dtype=torch.bool)
    if layout.topk_group < layout.n_group:
        ok &= ranked_groups[:, layout.topk_group - 1] - ranked_groups[:, layout.topk_group] >= MARGIN
    kept = torch.zeros_like(group_scores).scatter_(1, group_order[:, : layout.topk_group], 1).bool()
    choice = choice.masked_fill(~kept.repeat_interleave(layout.group_size, dim=1), float("-inf"))
    if layout.top_k < layout.topk_group * layout.group_size:
        ranked = choice.sort(dim=-1, descending=True)[0]
        ok &= ranked[:, layout.top_k - 1] - ranked[:, layout.top_k] >= MARGIN
    return ok


def make_routers(layout: Layout, seed: int):
    """The native router (and its MoE block where it does not select) and the Liger router, same state."""
    config = tiny_router_config(
        layout.num_experts,
        layout.top_k,
        layout.n_group,
        layout.topk_group,
        layout.norm_topk_prob,
        layout.routed_scaling_factor,
        hidden_size=HIDDEN,
    )
    torch.manual_seed(seed)
    native = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        native.weight.normal_(0.0, 0.5)
        native.e_score_correction_bias.normal_(layout.bias_offset, layout.bias_scale)
    liger = LigerDeepseekV3TopkRouter(config)
    liger.load_state_dict(native.state_dict())
    moe = None
    if not hasattr(native, "top_k"):  # transformers < 5.13
        moe = DeepseekV3MoE(config)
        moe.gate = native
    return native, liger, moe


def route(router, moe, hidden: torch.Tensor):
    """``(weights [T, K], indices [T, K])`` of the native or Liger router, in either transformers layout."""
    if moe is None:
        _, weights, indices = router(hidden)
        return weights, indices
    logits = router(hidden)
    if isinstance(router, LigerDeepseekV3TopkRouter):
        indices, weights = liger_route_tokens_to_experts(
            types.SimpleNamespace(gate=router, **_moe_options(moe)), logits
        )
    else:
        indices, weights = moe.route_tokens_to_experts(logits)
    return weights, indices


def _moe_options(moe) -> dict:
    names = ("top_k", "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor")
    return {name: getattr(moe, name) for name in names}


def by_index(weights: torch.Tensor, indices: torch.Tensor):
    sorted_indices, order = indices.sort(dim=-1)
    return weights.gather(1, order), sorted_indices


@pytest.mark.parametrize("seed,layout", list(enumerate(SWEEP)), ids=[layout_id(layout) for layout in SWEEP])
def test_routing_sweep_matches_native(seed, layout):
    native, liger, moe = make_routers(layout, seed)
    hidden = torch.randn(24, HIDDEN, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        logits = torch.nn.functional.linear(hidden, native.weight)
    keep = decisive(logits, native.e_score_correction_bias, layout)
    assert keep.sum() >= 12, "too many near ties: the comparison would be vacuous"
    hidden = hidden[keep]

    hidden_ours = hidden.clone().requires_grad_()
    hidden_ref = hidden.clone().requires_grad_()
    weights, indices = route(liger, moe, hidden_ours)
    ref_weights, ref_indices = route(native, moe, hidden_ref)

    assert weights.dtype == torch.float32 and indices.dtype == torch.int64
    assert weights.shape == indices.shape == (hidden.shape[0], layout.top_k)
    w, i = by_index(weights.detach(), indices)
    ref_w, ref_i = by_index(ref_weights.detach(), ref_indices)
    torch.testing.assert_close(i, ref_i, rtol=0, atol=0)
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)

    # One upstream gradient per (token, expert): the loss does not depend on the order of the k entries.
    upstream = torch.randn(hidden.shape[0], layout.num_experts, generator=torch.Generator().manual_seed(seed + 1))
    (weights * upstream.gather(1, indices)).sum().backward()
    (ref_weights * upstream.gather(1, ref_indices)).sum().backward()
    torch.testing.assert_close(hidden_ours.grad, hidden_ref.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(liger.weight.grad, native.weight.grad, rtol=1e-5, atol=1e-6)
    assert liger.e_score_correction_bias.grad is None


def test_sweep_covers_layouts_that_are_not_powers_of_two():
    odd_groups = [layout for layout in SWEEP if layout.group_size & (layout.group_size - 1)]
    odd_counts = [layout for layout in SWEEP if layout.n_group & (layout.n_group - 1)]
    assert len(SWEEP) == 48 and len(odd_groups) >= 15 and len(odd_counts) >= 10
    assert any(not layout.norm_topk_prob for layout in SWEEP)
    assert any(layout.top_k == layout.topk_group * layout.group_size for layout in SWEEP)
    assert any(layout.topk_group == layout.n_group > 1 for layout in SWEEP)


def native_routing(logits: torch.Tensor, bias: torch.Tensor, layout: Layout):
    """transformers' selection after the router GEMM (``DeepseekV3TopkRouter.forward``), on given logits."""
    scores = logits.sigmoid()
    choice = scores + bias
    group_scores = choice.view(-1, layout.n_group, layout.group_size).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=layout.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.repeat_interleave(layout.group_size, dim=1)
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    indices = torch.topk(choice, k=layout.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, indices)
    if layout.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * layout.routed_scaling_factor, indices


def test_exact_ties_take_the_lower_index():
    """Tied group scores keep the lower group; tied experts come lower index first; weights equal native ones."""
    layout = Layout(12, 3, 1, 2)
    # Groups 1 and 2 tie (0.9 + 0.9); within group 1, experts 4, 5 and 7 tie at 0.9.
    scores = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.9, 0.9, 0.2, 0.9, 0.9, 0.9, 0.1, 0.1]])
    logits = torch.logit(scores)
    bias = torch.zeros(12)
    weights, indices = liger_moe_router_topk(logits, bias, **layout.kwargs())
    assert indices.tolist() == [[4, 5]]
    ref_weights, ref_indices = native_routing(logits, bias, layout)
    assert ref_indices.div(4, rounding_mode="floor").unique().numel() == 1  # native keeps one of the tied groups
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=0)  # tied experts carry equal weights

    # Equal biased scores through different biases: the lower index wins, and its weight is its own score.
    logits = torch.logit(torch.tensor([[0.5, 0.7, 0.1, 0.1]]))
    bias = torch.tensor([0.2, 0.0, 0.0, 0.0])
    weights, indices = liger_moe_router_topk(logits, bias, top_k=1, n_group=2, topk_group=1, norm_topk_prob=False)
    assert indices.tolist() == [[0]]
    torch.testing.assert_close(weights, torch.tensor([[0.5]]))


NAN_LAYOUTS = [Layout(20, 4, 2, 4), Layout(20, 4, 2, 4, norm_topk_prob=False, routed_scaling_factor=2.5)]


@pytest.mark.parametrize("layout", NAN_LAYOUTS, ids=["norm", "nonorm"])
def test_nan_logits_rank_first_like_native(layout):
    """A NaN logit ranks above every score: its group is kept, it is chosen, and its weight is NaN, as natively."""
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(0)) * 2.0
    logits[0, 13] = NAN  # one NaN
    logits[1, 2] = logits[1, 17] = NAN  # two NaN in two groups
    bias = torch.randn(20, generator=torch.Generator().manual_seed(1)) * 0.1
    logits_ours = logits.clone().requires_grad_()
    logits_ref = logits.clone().requires_grad_()
    weights, indices = liger_moe_router_topk(logits_ours, bias, **layout.kwargs())
    ref_weights, ref_indices = native_routing(logits_ref, bias, layout)

    assert indices[0, 0] == 13 and indices[1, :2].tolist() == [2, 17]  # NaN first, the lower index first
    w, i = by_index(weights.detach(), indices)
    ref_w, ref_i = by_index(ref_weights.detach(), ref_indices)
    torch.testing.assert_close(i, ref_i, rtol=0, atol=0)
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6, equal_nan=True)
    nan_rows = w[:2].isnan()
    assert nan_rows.all() if layout.norm_topk_prob else nan_rows.sum() == 3
    assert not w[2].isnan().any()

    upstream = torch.randn(3, 20, generator=torch.Generator().manual_seed(2))
    (weights * upstream.gather(1, indices)).sum().backward()
    (ref_weights * upstream.gather(1, ref_indices)).sum().backward()
    torch.testing.assert_close(logits_ours.grad, logits_ref.grad, rtol=1e-5, atol=1e-6, equal_nan=True)


def test_more_nan_than_top_k():
    """Beyond ``top_k`` NaN, the lowest NaN experts are chosen, and the row's gradient is NaN everywhere (native's
    is NaN at the NaN logits, the places of the unchosen ones are not kept): a NaN never turns finite."""
    layout = Layout(8, 2, 1, 2)
    logits = torch.tensor([[0.1, NAN, 0.3, NAN, NAN, 0.2, NAN, 0.0]])
    bias = torch.zeros(8)
    logits_ours = logits.clone().requires_grad_()
    logits_ref = logits.clone().requires_grad_()
    weights, indices = liger_moe_router_topk(logits_ours, bias, **layout.kwargs())
    ref_weights, ref_indices = native_routing(logits_ref, bias, layout)
    assert indices.tolist() == [[1, 3]]
    assert weights.isnan().all() and ref_weights.isnan().all()
    assert set(ref_indices[0].tolist()) <= {1, 3, 4, 6}  # native takes some of the NaN experts

    weights.sum().backward()
    ref_weights.sum().backward()
    assert logits_ours.grad.isnan().all()
    assert logits_ref.grad[0, [1, 3, 4, 6]].isnan().all()  # native: 0 times the sigmoid's NaN derivative
    assert logits_ref.grad[0, [0, 2, 5, 7]].eq(0).all()


@pytest.mark.parametrize("layout", NAN_LAYOUTS, ids=["norm", "nonorm"])
def test_nan_hidden_row_gives_native_gradients(layout):
    """A NaN token (an overflow upstream): NaN weights in its row, and the native router and hidden gradients."""
    native, liger, moe = make_routers(layout, seed=3)
    hidden = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(3))
    hidden[2, 5] = NAN
    hidden_ours = hidden.clone().requires_grad_()
    hidden_ref = hidden.clone().requires_grad_()
    weights, indices = route(liger, moe, hidden_ours)
    ref_weights, ref_indices = route(native, moe, hidden_ref)

    assert indices[2].tolist() == [0, 1, 2, 3]  # all NaN: the first experts of the first groups
    assert weights[2].isnan().all() and ref_weights[2].isnan().all()
    rows = [0, 1, 3]
    w, i = by_index(weights.detach()[rows], indices[rows])
    ref_w, ref_i = by_index(ref_weights.detach()[rows], ref_indices[rows])
    torch.testing.assert_close(i, ref_i, rtol=0, atol=0)
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)

    upstream = torch.randn(4, 20, generator=torch.Generator().manual_seed(4))
    (weights * upstream.gather(1, indices)).sum().backward()
    (ref_weights * upstream.gather(1, ref_indices)).sum().backward()
    assert hidden_ours.grad[2].isnan().all()
    torch.testing.assert_close(hidden_ours.grad, hidden_ref.grad, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert liger.weight.grad.isnan().all()
    torch.testing.assert_close(liger.weight.grad, native.weight.grad, equal_nan=True)


def test_layouts_the_kernel_refuses():
    """Groups of one expert fail natively; more experts than the kept groups hold make native pick masked ones, tied
    at their masked score, in torch.topk's order: the kernel refuses that layout and names the router modules'
    native routing (``family/test_router_native_layouts.py``), and a top-k beyond the experts fails natively too."""
    logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(5))
    bias = torch.zeros(8)
    with pytest.raises(RuntimeError):
        native_routing(logits, bias, Layout(8, 8, 2, 2))
    with pytest.raises(ValueError, match="liger-dspine: each group needs at least 2 experts"):
        liger_moe_router_topk(logits, bias, top_k=2, n_group=8, topk_group=2)
    _, ref_indices = native_routing(logits, bias, Layout(8, 2, 1, 5))
    assert (ref_indices.div(4, rounding_mode="floor") != ref_indices[:, :1].div(4, rounding_mode="floor")).any()
    assert masked_topk_reason(8, 5, 2, 1).startswith("num_experts_per_tok=5 exceeds the 4 experts")
    with pytest.raises(
        ValueError, match=r"liger-dspine: num_experts_per_tok=5 .*; the router modules route such a layout with"
    ):
        liger_moe_router_topk(logits, bias, top_k=5, n_group=2, topk_group=1)
    with pytest.raises(RuntimeError):
        native_routing(logits, bias, Layout(8, 2, 1, 9))
    assert masked_topk_reason(8, 9, 2, 1) is None
    with pytest.raises(
        ValueError,
        match=r"num_experts_per_tok=9 must be in \[1, topk_group \* group size = 4\] for the routing kernel$",
    ):
        liger_moe_router_topk(logits, bias, top_k=9, n_group=2, topk_group=1)


@pytest.mark.skipif(Version(transformers.__version__) < Version("5.24"), reason="checked on transformers >= 5.24 only")
@pytest.mark.parametrize("layout", [Layout(8, 2, 1, 8), Layout(12, 3, 1, 7), Layout(20, 4, 2, 11)], ids=layout_id)
def test_layouts_beyond_the_kept_groups_route_as_native(layout):
    """The router (or, before transformers 5.13, the MoE block's method) runs transformers' own routing there: the
    same indices in the same order, weights and gradients, exactly."""
    native, liger, moe = make_routers(layout, seed=11)
    hidden = torch.randn(16, HIDDEN, generator=torch.Generator().manual_seed(11))
    hidden_ours, hidden_ref = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    weights, indices = route(liger, moe, hidden_ours)
    ref_weights, ref_indices = route(native, moe, hidden_ref)
    assert torch.equal(indices, ref_indices) and torch.equal(weights, ref_weights)
    upstream = torch.randn(weights.shape, generator=torch.Generator().manual_seed(12))
    (weights * upstream).sum().backward()
    (ref_weights * upstream).sum().backward()
    assert torch.equal(hidden_ours.grad, hidden_ref.grad) and torch.equal(liger.weight.grad, native.weight.grad)
