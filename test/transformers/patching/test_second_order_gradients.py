"""Second-order gradients (``create_graph=True``: a gradient penalty, a Hessian-vector product) through a patched
model: the kernels have first-order gradients only, so such a backward is refused by name instead of missing the
second-order terms through them (the loss kernels' saved gradients, the norms' statistics) or failing deep inside
torch. Native modules, where every kernel option is off, still give them."""

import pytest
import torch
from liger_kernel.ops import LigerSiLUMulFunction

from liger_dspine import apply_liger_kernel_to_deepseek_v3
from liger_dspine.ops.first_order import first_order_boundary
from tiny_models import build_model
from tiny_models import random_batch
from tiny_models import tiny_deepseek_v3_config

REFUSED = "has first-order gradients only"
KERNELS_OFF = dict(rope=False, rms_norm=False, swiglu=False, moe_router=False)


def gradient_penalty(model, config):
    """The squared norm of the loss's gradient with respect to the input embeddings, back-propagated."""
    input_ids, labels = random_batch(config)
    embeds = model.get_input_embeddings()(input_ids).detach().requires_grad_(True)
    loss = model(inputs_embeds=embeds, labels=labels).loss
    (grad,) = torch.autograd.grad(loss, embeds, create_graph=True)
    grad.pow(2).sum().backward()
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "options",
    [
        {},  # every kernel
        KERNELS_OFF,  # only the fused linear cross entropy: second-order terms were silently missing
        {**KERNELS_OFF, "cross_entropy": True, "fused_linear_cross_entropy": False},
        {**KERNELS_OFF, "vocab_chunked_lce": True},
        dict(cross_entropy=False, fused_linear_cross_entropy=False),  # the native loss, the decoder's kernels
    ],
    ids=["defaults", "fused-loss-only", "ce-only", "vocab-chunked-only", "decoder-kernels-only"],
)
def test_a_graph_building_backward_is_refused(options):
    config = tiny_deepseek_v3_config()
    model = build_model(config).train()
    apply_liger_kernel_to_deepseek_v3(model=model, **options)
    with pytest.raises(RuntimeError, match=REFUSED):
        gradient_penalty(model, config)


def test_with_every_kernel_off_the_penalty_is_native():
    config = tiny_deepseek_v3_config()
    native = build_model(config).train()
    patched = build_model(config).train()
    off = dict(KERNELS_OFF, cross_entropy=False, fused_linear_cross_entropy=False, grouped_experts=False)
    apply_liger_kernel_to_deepseek_v3(model=patched, **off)
    expected, actual = gradient_penalty(native, config), gradient_penalty(patched, config)
    assert expected.keys() == actual.keys() and "lm_head.weight" in expected
    for name, grad in expected.items():
        torch.testing.assert_close(actual[name], grad, rtol=1e-5, atol=1e-7)


def test_the_boundary_on_another_package_kernel_keeps_first_order_gradients_and_refuses_second_order():
    gate, up = torch.randn(4, 6, requires_grad=True), torch.randn(4, 6, requires_grad=True)
    weight = torch.randn(4, 6)
    plain = torch.autograd.grad((LigerSiLUMulFunction.apply(gate, up) * weight).sum(), (gate, up))
    bounded = first_order_boundary(LigerSiLUMulFunction.apply(gate, up), "liger-kernel's LigerSiLUMulFunction")
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad((bounded * weight).sum(), (gate, up)), plain))
    bounded = first_order_boundary(LigerSiLUMulFunction.apply(gate, up), "liger-kernel's LigerSiLUMulFunction")
    with pytest.raises(RuntimeError, match="liger-kernel's LigerSiLUMulFunction has first-order gradients only"):
        torch.autograd.grad((bounded * weight).sum(), (gate, up), create_graph=True)
