"""MiniCPM5-MoE's router computes its logits in fp32 with autocast off: the Liger router gives the native logits,
weights, indices and gradients under autocast too (where DeepSeek-V3's would run the GEMM in bf16). Its gated
attention stays native: rope=True is refused by name."""

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tiny_family import CASES  # noqa: E402

pytestmark = pytest.mark.matrix

CASE = CASES["minicpm5_moe"]
RTOL = 1e-5  # fp32 GEMMs and selection on both sides; the kernel sums in another order


def routers():
    modeling = CASE.modeling_or_skip()
    from liger_dspine.models.minicpm5_moe.modules import LigerMiniCPM5MoeTopkRouter

    torch.manual_seed(0)
    native = modeling.MiniCPM5MoeTopkRouter(CASE.config())
    torch.nn.init.normal_(native.weight, std=0.5)
    torch.nn.init.normal_(native.e_score_correction_bias, std=0.1)
    liger = copy.deepcopy(native)
    liger.__class__ = LigerMiniCPM5MoeTopkRouter  # a subclass adding no state, as the instance patch converts it
    return native, liger


def run(router, hidden):
    hidden = hidden.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, weights, indices = router(hidden)
    order = indices.sort(dim=-1)
    weights = weights.gather(1, order.indices)
    (weights * torch.arange(1.0, weights.shape[1] + 1)).sum().backward()
    return logits, weights, order.values, hidden.grad, router.weight.grad


def test_router_under_autocast_matches_native():
    native, liger = routers()
    hidden = torch.randn(2, 8, native.hidden_dim, generator=torch.Generator().manual_seed(1))
    logits, weights, indices, hidden_grad, weight_grad = run(liger, hidden)
    ref_logits, ref_weights, ref_indices, ref_hidden_grad, ref_weight_grad = run(native, hidden)
    assert logits.dtype == torch.float32
    assert torch.equal(indices, ref_indices)
    for name, value, ref in (
        ("logits", logits, ref_logits),
        ("weights", weights, ref_weights),
        ("hidden grad", hidden_grad, ref_hidden_grad),
        ("weight grad", weight_grad, ref_weight_grad),
    ):
        torch.testing.assert_close(value, ref, rtol=RTOL, atol=RTOL * ref.abs().max().item(), msg=name)


def test_rope_is_refused():
    with pytest.raises(ValueError, match="liger-dspine: the minicpm5_moe patch leaves its gated GQA attention native"):
        CASE.apply_fn()(rope=True)
