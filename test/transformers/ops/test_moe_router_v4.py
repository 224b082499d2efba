"""DeepSeek-V4's routers on the routing ops against transformers' routers.

The learned router (``DeepseekV4TopKRouter``: sqrtsoftplus or sigmoid scores, correction bias, top-k of all experts,
renormalised and scaled) runs in the MoE router kernel; the hash router (``DeepseekV4HashRouter``: experts from a
token table) computes the table experts' weights only. Indices, weights and the gradients of the router weight and
the hidden states are compared with native modules of the same weights in fp32, over a seeded sweep of layouts;
tokens whose choice is decided by less than ``MARGIN`` are dropped first so that rounding cannot flip a near tie.
The score function's derivative is also checked against fp64 autograd over the whole range of logits.
"""

import random

import pytest
import torch
import torch.nn.functional as F

modeling = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")

from liger_dspine.models.deepseek_v4.router import LigerDeepseekV4HashRouter  # noqa: E402
from liger_dspine.models.deepseek_v4.router import LigerDeepseekV4TopKRouter  # noqa: E402
from liger_dspine.ops.hash_router import liger_hash_router_weights  # noqa: E402
from liger_dspine.ops.moe_router import liger_moe_router_topk  # noqa: E402

MARGIN = 1e-5
HIDDEN = 8
VOCAB = 50


def v4_config(num_experts, top_k, scoring_func="sqrtsoftplus", scaling=1.5):
    return modeling.DeepseekV4Config(
        hidden_size=HIDDEN,
        vocab_size=VOCAB,
        num_local_experts=num_experts,
        n_routed_experts=num_experts,
        num_experts_per_tok=top_k,
        scoring_func=scoring_func,
        routed_scaling_factor=scaling,
    )


def router_pair(kind, config, seed):
    torch.manual_seed(seed)
    native_class = modeling.DeepseekV4TopKRouter if kind == "topk" else modeling.DeepseekV4HashRouter
    native = native_class(config)
    with torch.no_grad():
        native.weight.normal_(0.0, 1.0)
        if kind == "topk":
            native.e_score_correction_bias.copy_(torch.randn(config.num_local_experts) * 0.3)
        else:
            table = torch.stack([torch.randperm(config.num_local_experts)[: native.top_k] for _ in range(VOCAB)])
            native.tid2eid.copy_(table)
    liger_class = LigerDeepseekV4TopKRouter if kind == "topk" else LigerDeepseekV4HashRouter
    liger = liger_class(config)
    liger.load_state_dict(native.state_dict())
    return native, liger


def run(router, hidden, input_ids):
    hidden = hidden.clone().requires_grad_(True)
    router.zero_grad(set_to_none=True)
    args = (hidden,) if input_ids is None else (hidden, input_ids)
    logits, weights, indices = router(*args)
    order = indices.argsort(dim=-1)  # compare as sets: native's topk(sorted=False) has no defined order
    indices, weights = indices.gather(1, order), weights.gather(1, order)
    grad = torch.randn(weights.shape, generator=torch.Generator().manual_seed(3)).to(weights.device, weights.dtype)
    (weights * grad).sum().backward()
    return logits, weights, indices, hidden.grad, router.weight.grad


def decided_tokens(native, hidden, top_k):
    """Tokens whose k-th and (k+1)-th biased scores differ by at least MARGIN (fp64)."""
    with torch.no_grad():
        logits = F.linear(hidden.double(), native.weight.double())
        choice = F.softplus(logits).sqrt() + native.e_score_correction_bias.double()
        if isinstance(native.score_fn, torch.nn.Sigmoid):
            choice = torch.sigmoid(logits) + native.e_score_correction_bias.double()
        top = choice.topk(min(top_k + 1, choice.shape[1]), dim=-1).values
    if top.shape[1] <= top_k:
        return torch.ones(hidden.shape[0], dtype=torch.bool)
    return (top[:, top_k - 1] - top[:, top_k]) >= MARGIN


LAYOUTS = [(4, 2), (6, 1), (6, 6), (16, 4), (20, 3), (64, 6)]
rng = random.Random(14)
LAYOUTS += [(e, rng.randint(1, min(e, 8))) for e in (rng.randint(2, 96) for _ in range(6))]


@pytest.mark.parametrize("scoring_func", ["sqrtsoftplus", "sigmoid"])
@pytest.mark.parametrize("num_experts, top_k", LAYOUTS)
def test_learned_router_matches_native(num_experts, top_k, scoring_func):
    config = v4_config(num_experts, top_k, scoring_func, scaling=rng.choice([1.0, 1.5, 2.5]))
    native, liger = router_pair("topk", config, seed=num_experts * 7 + top_k)
    hidden = torch.randn(64, HIDDEN, generator=torch.Generator().manual_seed(num_experts)) * 3.0
    hidden = hidden[decided_tokens(native, hidden, top_k)]
    assert hidden.shape[0] >= 32
    expected, got = run(native, hidden, None), run(liger, hidden, None)
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)  # the same router GEMM
    assert torch.equal(got[2], expected[2])
    for name, a, b in zip(("weights", "hidden grad", "weight grad"), got[1:2] + got[3:], expected[1:2] + expected[3:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("scoring_func", ["sqrtsoftplus", "sigmoid"])
@pytest.mark.parametrize("num_experts, top_k", [(4, 2), (16, 6), (20, 3), (64, 8)])
def test_hash_router_matches_native(num_experts, top_k, scoring_func):
    config = v4_config(num_experts, top_k, scoring_func)
    native, liger = router_pair("hash", config, seed=num_experts + top_k)
    hidden = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(5)) * 3.0
    input_ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(6))
    expected, got = run(native, hidden, input_ids), run(liger, hidden, input_ids)
    assert torch.equal(got[2], expected[2])
    for name, a, b in zip(("weights", "hidden grad", "weight grad"), got[1:2] + got[3:], expected[1:2] + expected[3:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("route", ["topk", "hash"])
def test_sqrtsoftplus_gradient_over_the_whole_range_of_logits(route):
    """Logits from -40 to 40 (softplus's series, its threshold at 20): weights and logit gradients against fp64."""
    logits = torch.linspace(-40.0, 40.0, 321).view(-1, 1) + torch.tensor([0.0, -3.0, 1.0, -8.0])
    indices = torch.tensor([[0, 1, 2, 3]]).expand(logits.shape[0], -1)
    grad = torch.randn(logits.shape[0], 4, generator=torch.Generator().manual_seed(1))

    reference = logits.double().requires_grad_(True)
    scores = F.softplus(reference).sqrt()
    weights = scores / (scores.sum(-1, keepdim=True) + 1e-20) * 2.0
    (weights * grad.double()).sum().backward()

    fp32 = logits.clone().requires_grad_(True)
    if route == "topk":
        got, got_indices = liger_moe_router_topk(fp32, None, 4, 1, 1, True, 2.0, score_func="sqrtsoftplus")
        order = got_indices.argsort(dim=-1)
        got, got_indices = got.gather(1, order), got_indices.gather(1, order)
        assert torch.equal(got_indices, indices)
    else:
        got = liger_hash_router_weights(fp32, indices, "sqrtsoftplus", 2.0)
    (got * grad).sum().backward()
    torch.testing.assert_close(got.double(), weights.detach(), rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(fp32.grad.double(), reference.grad, rtol=1e-4, atol=1e-6)


def test_an_unsupported_score_function_is_refused():
    config = v4_config(8, 2, scoring_func="relu")
    router = LigerDeepseekV4TopKRouter(config)
    with pytest.raises(ValueError, match="sqrtsoftplus or sigmoid"):
        router(torch.randn(4, HIDDEN))
    with pytest.raises(ValueError, match="score_func"):
        liger_hash_router_weights(torch.randn(4, 8), torch.zeros(4, 2, dtype=torch.long), "softmax", 1.0)


@pytest.mark.cuda
@pytest.mark.parametrize("route", ["topk", "hash"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routers_match_native_cuda(route, dtype):
    """On the GPU: fp32 as on the CPU; bf16 (native scores in bf16, these in fp32) within bf16 rounding."""
    config = v4_config(64, 6)
    native, liger = router_pair(route, config, seed=9)
    hidden = torch.randn(512, HIDDEN, generator=torch.Generator().manual_seed(2)) * 3.0
    if route == "topk":
        hidden = hidden[decided_tokens(native, hidden, 6)]
    native, liger = native.to("cuda", dtype), liger.to("cuda", dtype)
    hidden = hidden.to("cuda", dtype)
    input_ids = None if route == "topk" else torch.randint(0, VOCAB, (hidden.shape[0],), device="cuda")
    expected, got = run(native, hidden, input_ids), run(liger, hidden, input_ids)
    same = (got[2] == expected[2]).all(dim=-1)  # bf16 scores may reorder near ties
    assert same.float().mean() > (0.999 if dtype == torch.float32 else 0.95)
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got[1][same].float(), expected[1][same].float(), **tolerance)
    if dtype == torch.float32:
        torch.testing.assert_close(got[3], expected[3], **tolerance)
        torch.testing.assert_close(got[4], expected[4], **tolerance)
