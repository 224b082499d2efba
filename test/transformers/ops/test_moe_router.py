"""DeepSeek-V3 MoE router kernel and router module against transformers' DeepseekV3TopkRouter (fp32).

Routing is compared as sets (the order of the k entries of a token is unspecified natively) on rows without near
ties: a row whose group or expert choice is decided by less than ``MARGIN`` (in fp64) is left out, since an fp32
rounding difference may legitimately flip it.
"""

import types
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from liger_dspine.models.deepseek_v3.router import LigerDeepseekV3TopkRouter
from liger_dspine.models.deepseek_v3.router import liger_route_tokens_to_experts
from liger_dspine.ops.moe_router import liger_moe_router_topk
from liger_dspine.ops.moe_router import liger_router_logits
from tiny_models import tiny_deepseek_v3_config
from tiny_models import tiny_router_config

pytestmark = pytest.mark.matrix  # runs against every transformers version of the matrix

MARGIN = 1e-5


# transformers < 5.13: the router returns only its logits and DeepseekV3MoE.route_tokens_to_experts selects
# (that layout is covered by the whole-model patch tests).
ROUTER_SELECTS = pytest.mark.skipif(
    not hasattr(DeepseekV3TopkRouter(tiny_deepseek_v3_config(n_routed_experts=8)), "top_k"),
    reason="this transformers version routes in DeepseekV3MoE.route_tokens_to_experts",
)


@dataclass(frozen=True)
class RouterConfig:
    num_experts: int
    n_group: int
    topk_group: int
    top_k: int
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0

    def hf_config(self, hidden_size: int) -> DeepseekV3Config:
        return tiny_router_config(
            self.num_experts,
            self.top_k,
            self.n_group,
            self.topk_group,
            self.norm_topk_prob,
            self.routed_scaling_factor,
            hidden_size=hidden_size,
        )

    def kwargs(self) -> dict:
        return dict(
            top_k=self.top_k,
            n_group=self.n_group,
            topk_group=self.topk_group,
            norm_topk_prob=self.norm_topk_prob,
            routed_scaling_factor=self.routed_scaling_factor,
        )


TINY = RouterConfig(8, n_group=2, topk_group=1, top_k=2)
SMALL = RouterConfig(16, n_group=2, topk_group=1, top_k=2)  # the measured slim model
DEEPSEEK_V3 = RouterConfig(256, n_group=8, topk_group=4, top_k=8, routed_scaling_factor=2.5)
PADDED = RouterConfig(24, n_group=3, topk_group=2, top_k=3)  # 3 groups of 6: both group axes padded

CONFIGS = [
    pytest.param(TINY, id="e8-tiny"),
    pytest.param(RouterConfig(8, 2, 1, 2, norm_topk_prob=False, routed_scaling_factor=2.5), id="e8-nonorm-scaled"),
    pytest.param(SMALL, id="e16"),
    pytest.param(RouterConfig(16, 4, 2, 4, routed_scaling_factor=1.5), id="e16-4groups-scaled"),
    pytest.param(RouterConfig(16, 4, 2, 4, norm_topk_prob=False), id="e16-4groups-nonorm"),
    pytest.param(PADDED, id="e24-padded"),
    pytest.param(DEEPSEEK_V3, id="e256-deepseek-v3"),
    pytest.param(RouterConfig(256, 8, 4, 8, norm_topk_prob=False, routed_scaling_factor=2.5), id="e256-nonorm"),
]


def native_routing(logits: torch.Tensor, bias: torch.Tensor, cfg: RouterConfig):
    """transformers' selection from the logits (``DeepseekV3TopkRouter.forward`` after its GEMM)."""
    scores = logits.sigmoid()
    choice = scores + bias
    group_scores = choice.view(-1, cfg.n_group, cfg.num_experts // cfg.n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=cfg.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.repeat_interleave(cfg.num_experts // cfg.n_group, dim=1)
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    indices = torch.topk(choice, k=cfg.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, indices)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, indices


def decisive_rows(logits: torch.Tensor, bias: torch.Tensor, cfg: RouterConfig) -> torch.Tensor:
    """Rows whose group and expert choices are each decided by at least ``MARGIN`` (fp64)."""
    choice = logits.double().sigmoid() + bias.double()
    group_size = cfg.num_experts // cfg.n_group
    group_scores = choice.view(-1, cfg.n_group, group_size).topk(2, dim=-1)[0].sum(dim=-1)
    ok = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
    ranked_groups, group_order = group_scores.sort(dim=-1, descending=True)
    if cfg.topk_group < cfg.n_group:
        ok &= ranked_groups[:, cfg.topk_group - 1] - ranked_groups[:, cfg.topk_group] >= MARGIN
    kept = torch.zeros_like(group_scores).scatter_(1, group_order[:, : cfg.topk_group], 1).bool()
    choice = choice.masked_fill(~kept.repeat_interleave(group_size, dim=1), float("-inf"))
    if cfg.top_k < cfg.topk_group * group_size:
        ranked = choice.sort(dim=-1, descending=True)[0]
        ok &= ranked[:, cfg.top_k - 1] - ranked[:, cfg.top_k] >= MARGIN
    return ok


def by_index(weights: torch.Tensor, indices: torch.Tensor):
    sorted_indices, order = indices.sort(dim=-1)
    return weights.gather(1, order), sorted_indices


def assert_same_routing(weights, indices, ref_weights, ref_indices, rows, rtol=1e-5, atol=1e-6):
    assert rows.float().mean() > 0.9, "too many near ties: the comparison would be vacuous"
    w, i = by_index(weights[rows], indices[rows])
    ref_w, ref_i = by_index(ref_weights[rows], ref_indices[rows])
    torch.testing.assert_close(i, ref_i, rtol=0, atol=0)
    torch.testing.assert_close(w, ref_w, rtol=rtol, atol=atol)


def random_inputs(cfg: RouterConfig, num_tokens: int, device, seed: int = 0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    logits = torch.randn(num_tokens, cfg.num_experts, generator=gen) * 2.0
    bias = torch.randn(cfg.num_experts, generator=gen) * 0.1
    return logits.to(device), bias.to(device)


def check_forward_backward(cfg: RouterConfig, num_tokens: int, device, rtol=1e-5, atol=1e-6):
    logits, bias = random_inputs(cfg, num_tokens, device)
    logits_ours = logits.clone().requires_grad_()
    logits_ref = logits.clone().requires_grad_()
    weights, indices = liger_moe_router_topk(logits_ours, bias, **cfg.kwargs())
    ref_weights, ref_indices = native_routing(logits_ref, bias, cfg)

    assert weights.dtype == torch.float32 and indices.dtype == torch.int64
    assert weights.shape == indices.shape == (num_tokens, cfg.top_k)
    rows = decisive_rows(logits, bias, cfg)
    assert_same_routing(weights.detach(), indices, ref_weights.detach(), ref_indices, rows, rtol, atol)
    # Documented order: by biased score, largest first.
    choice = logits.sigmoid() + bias
    assert (choice.gather(1, indices).diff(dim=-1) <= 0).all()

    # An upstream gradient per (token, expert) makes the loss independent of the order of the k entries.
    upstream = torch.randn(num_tokens, cfg.num_experts, generator=torch.Generator().manual_seed(1)).to(device)
    (weights * upstream.gather(1, indices)).sum().backward()
    (ref_weights * upstream.gather(1, ref_indices)).sum().backward()
    torch.testing.assert_close(logits_ours.grad[rows], logits_ref.grad[rows], rtol=rtol, atol=atol)


@pytest.mark.parametrize("cfg", CONFIGS)
def test_routing_matches_native(cfg, device):
    num_tokens = 6 if cfg.num_experts == 256 else 16
    check_forward_backward(cfg, num_tokens, device)


@pytest.mark.cuda
@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("num_tokens", [1, 8192, 8191])
def test_routing_matches_native_cuda(cfg, num_tokens):
    check_forward_backward(cfg, num_tokens, "cuda")


def test_no_tokens(device):
    logits, bias = random_inputs(TINY, 0, device)
    weights, indices = liger_moe_router_topk(logits, bias, **TINY.kwargs())
    assert weights.shape == indices.shape == (0, TINY.top_k)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(top_k=2, n_group=3, topk_group=1),  # 8 experts do not split into 3 groups
        dict(top_k=2, n_group=8, topk_group=1),  # groups of one expert
        dict(top_k=2, n_group=2, topk_group=3),
        dict(top_k=5, n_group=2, topk_group=1),  # more experts than the kept groups hold
    ],
)
def test_invalid_config(kwargs, device):
    logits, bias = random_inputs(TINY, 2, device)
    with pytest.raises(ValueError):
        liger_moe_router_topk(logits, bias, **kwargs)


def make_routers(cfg: RouterConfig, hidden_size: int = 32, seed: int = 0):
    torch.manual_seed(seed)
    native = DeepseekV3TopkRouter(cfg.hf_config(hidden_size))
    with torch.no_grad():
        native.weight.normal_(0.0, 0.3)
        native.e_score_correction_bias.normal_(0.0, 0.1)
    liger = LigerDeepseekV3TopkRouter(cfg.hf_config(hidden_size))
    liger.load_state_dict(native.state_dict())
    return native, liger


@ROUTER_SELECTS
@pytest.mark.parametrize("cfg", [TINY, PADDED, DEEPSEEK_V3], ids=["e8", "e24", "e256"])
@pytest.mark.parametrize("hidden_dtype", [torch.float32, torch.bfloat16])
def test_router_module_matches_native(cfg, hidden_dtype, device):
    native, liger = make_routers(cfg)
    native.to(device)
    liger.to(device)
    assert liger.state_dict().keys() == native.state_dict().keys()
    for (name, a), (_, b) in zip(native.named_buffers(), liger.named_buffers()):
        assert a.dtype == b.dtype, name

    hidden = torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(2)).to(device, hidden_dtype)
    hidden_ours = hidden.clone().requires_grad_()
    hidden_ref = hidden.clone().requires_grad_()
    logits, weights, indices = liger(hidden_ours)
    ref_logits, ref_weights, ref_indices = native(hidden_ref)

    torch.testing.assert_close(logits, ref_logits, rtol=1e-6, atol=1e-6)
    rows = decisive_rows(ref_logits.detach(), native.e_score_correction_bias, cfg)
    assert_same_routing(weights.detach(), indices, ref_weights.detach(), ref_indices, rows)

    upstream = torch.randn(6, cfg.num_experts, generator=torch.Generator().manual_seed(3)).to(device)
    logits_upstream = torch.randn(6, cfg.num_experts, generator=torch.Generator().manual_seed(4)).to(device)
    ((weights * upstream.gather(1, indices)).sum() + (logits * logits_upstream).sum()).backward()
    ((ref_weights * upstream.gather(1, ref_indices)).sum() + (ref_logits * logits_upstream).sum()).backward()
    assert rows.all(), "module test inputs must be free of near ties"
    assert hidden_ours.grad.dtype == hidden_dtype
    torch.testing.assert_close(hidden_ours.grad, hidden_ref.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(liger.weight.grad, native.weight.grad, rtol=1e-5, atol=1e-6)
    assert liger.e_score_correction_bias.grad is None


@ROUTER_SELECTS
def test_class_swap_of_a_native_instance(device):
    native, _ = make_routers(SMALL)
    native.to(device)
    hidden = torch.randn(5, 32, generator=torch.Generator().manual_seed(5)).to(device)
    with torch.no_grad():
        ref_logits, ref_weights, ref_indices = native(hidden)
        native.__class__ = LigerDeepseekV3TopkRouter
        logits, weights, indices = native(hidden)
    torch.testing.assert_close(logits, ref_logits)
    assert_same_routing(
        weights, indices, ref_weights, ref_indices, decisive_rows(ref_logits, native.e_score_correction_bias, SMALL)
    )


def test_router_logits_keep_low_precision_input(device):
    """The fp32 GEMM saves the bf16 hidden states, and the gradients equal the native expression's."""
    hidden = torch.randn(7, 32, generator=torch.Generator().manual_seed(6)).to(device, torch.bfloat16)
    weight = torch.randn(8, 32, generator=torch.Generator().manual_seed(7)).to(device, torch.bfloat16)
    upstream = torch.randn(7, 8, generator=torch.Generator().manual_seed(8)).to(device)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = liger_router_logits(h1, w1)
    ref = F.linear(h2.float(), w2.float())
    assert out.dtype == torch.float32
    assert out.grad_fn.saved_tensors[0].dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    (out * upstream).sum().backward()
    (ref * upstream).sum().backward()
    torch.testing.assert_close(h1.grad, h2.grad, rtol=0, atol=0)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=0, atol=0)


def test_router_under_autocast_runs_like_native(device):
    native, liger = make_routers(TINY)
    native.to(device)
    liger.to(device)
    hidden = torch.randn(4, 32, generator=torch.Generator().manual_seed(9)).to(device)
    with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16):
        ours = liger(hidden)
        ref = native(hidden)
    assert [t.dtype for t in ours] == [t.dtype for t in ref]
    torch.testing.assert_close(ours[0], ref[0])


def old_layout_router(cfg: RouterConfig, hidden_size: int = 32) -> LigerDeepseekV3TopkRouter:
    """A router shaped like transformers 5.8.1-5.12's (only ``config``, ``weight`` and the bias)."""
    router = LigerDeepseekV3TopkRouter.__new__(LigerDeepseekV3TopkRouter)
    torch.nn.Module.__init__(router)
    router.config = cfg.hf_config(hidden_size)
    router.weight = torch.nn.Parameter(torch.randn(cfg.num_experts, hidden_size) * 0.3)
    router.register_buffer("e_score_correction_bias", torch.randn(cfg.num_experts) * 0.1)
    return router


@pytest.mark.parametrize("cfg", [TINY, RouterConfig(16, 4, 2, 4, routed_scaling_factor=2.5)], ids=["e8", "e16"])
def test_old_transformers_layout(cfg, device):
    torch.manual_seed(10)
    router = old_layout_router(cfg).to(device)
    hidden = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(11)).to(device)
    logits = router(hidden)
    assert isinstance(logits, torch.Tensor)
    torch.testing.assert_close(logits, F.linear(hidden.view(-1, 32), router.weight))

    moe = types.SimpleNamespace(gate=router, n_routed_experts=cfg.num_experts, **cfg.kwargs())
    with torch.no_grad():
        indices, weights = liger_route_tokens_to_experts(moe, logits)
        ref_weights, ref_indices = native_routing(logits, router.e_score_correction_bias, cfg)
    rows = decisive_rows(logits.detach(), router.e_score_correction_bias, cfg)
    assert_same_routing(weights, indices, ref_weights, ref_indices, rows)


def test_tied_maximum_counts_twice_in_group_score(device):
    """A group whose two best experts tie scores both of them (native topk(2) returns the tie twice)."""
    logits = torch.tensor([[1.0, 1.0, -5.0, -5.0, 1.5, -5.0, -5.0, -5.0]], device=device)
    bias = torch.zeros(8, device=device)
    weights, indices = liger_moe_router_topk(logits, bias, **TINY.kwargs())
    ref_weights, ref_indices = native_routing(logits, bias, TINY)
    assert sorted(indices[0].tolist()) == sorted(ref_indices[0].tolist()) == [0, 1]
    torch.testing.assert_close(weights, ref_weights)


def test_compiled_router_logits_keep_no_fp32_copy_of_the_input():
    """Under torch.compile the partitioner chooses what the forward hands the backward: the weight gradient is one
    op of the bf16 input, so no fp32 [T, H] copy is kept (it would be twice the input's bytes per MoE layer)."""
    from functorch.compile import make_boxed_func
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(32, 48, generator=generator).to(torch.bfloat16).requires_grad_()
    weight = torch.randn(8, 48, generator=generator).to(torch.bfloat16).requires_grad_()
    handed_over = []

    def forward_compiler(gm, example_inputs):
        output = next(node for node in gm.graph.nodes if node.op == "output")
        handed_over.extend(node.meta["val"] for node in output.args[0] if hasattr(node, "meta") and "val" in node.meta)
        return make_boxed_func(gm.forward)

    def step(h, w):
        return liger_router_logits(h, w).square().sum()

    torch._dynamo.reset()
    backend = aot_autograd(
        fw_compiler=forward_compiler,
        bw_compiler=lambda gm, inputs: make_boxed_func(gm.forward),
        partition_fn=min_cut_rematerialization_partition,
    )
    compiled_grads = torch.autograd.grad(
        torch.compile(step, backend=backend, fullgraph=True)(hidden, weight), (hidden, weight)
    )
    eager_grads = torch.autograd.grad(step(hidden, weight), (hidden, weight))
    fp32_inputs = [t for t in handed_over if t.dtype == torch.float32 and tuple(t.shape) in ((32, 48), (48, 32))]
    assert handed_over and not fp32_inputs, [(t.dtype, tuple(t.shape)) for t in handed_over]
    for compiled, eager in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(compiled, eager, atol=0, rtol=0)
