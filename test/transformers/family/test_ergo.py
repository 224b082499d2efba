"""Ergo's own pieces (tiny model of tiny_family.py, fp32 on CPU): the loss on Liger's cross entropy against native,
greedy generation, the norm's fp32 weight, the router's weights rounded as natively, and the options it refuses by
name."""

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tiny_family import CASES  # noqa: E402

pytestmark = pytest.mark.matrix

CASE = CASES["ergo"]
# fp32 on both sides, one step from the same weights: the kernels sum in another order (1e-6 level per op)
RTOL = 1e-5


def loss_and_grads(model, input_ids):
    model.zero_grad(set_to_none=True)
    output = model(input_ids=input_ids, labels=input_ids)
    output.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return output, grads


def test_cross_entropy_gives_the_native_loss_logits_and_gradients():
    from liger_dspine.modules.causal_lm_forward import ce_forward

    native = CASE.build()
    patched = copy.deepcopy(native)
    report = CASE.apply_fn()(model=patched, cross_entropy=True)
    assert patched.forward.__func__ is ce_forward
    assert "ErgoForCausalLM.forward of the instance" in {r.target for r in report}
    input_ids = torch.randint(0, CASE.vocab_size, (2, 8), generator=torch.Generator().manual_seed(7))
    (output, grads), (ref_output, ref_grads) = loss_and_grads(patched, input_ids), loss_and_grads(native, input_ids)
    torch.testing.assert_close(output.loss, ref_output.loss, rtol=RTOL, atol=0)
    assert output.logits.dtype == torch.float32
    torch.testing.assert_close(
        output.logits, ref_output.logits, rtol=RTOL, atol=RTOL * ref_output.logits.abs().max().item()
    )
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=RTOL, atol=RTOL * ref.abs().max().item(), msg=name)


@pytest.mark.parametrize(
    "option, message",
    [
        ("rope", "the ergo patch leaves its GQA attention native"),
        ("fused_linear_cross_entropy", r"the ergo patch cannot take fused_linear_cross_entropy=True: Ergo's head"),
        ("swiglu", "the ergo patch cannot take swiglu=True: Ergo's MLPs, shared expert and routed experts are ReLU"),
    ],
)
def test_options_it_cannot_honour_are_refused_before_anything_changes(option, message):
    model = CASE.build()
    before = {name: type(m) for name, m in model.named_modules()}
    with pytest.raises(ValueError, match=f"liger-dspine: {message}"):
        CASE.apply_fn()(model=model, **{option: True})
    assert {name: type(m) for name, m in model.named_modules()} == before


def test_norm_built_under_the_class_patch_keeps_an_fp32_weight():
    modeling = CASE.modeling_or_skip()
    from liger_dspine.models.ergo.modules import LigerErgoRMSNorm

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # as from_pretrained(dtype=torch.bfloat16) builds the modules
    try:
        native, liger = modeling.ErgoRMSNorm(8, eps=1e-6), LigerErgoRMSNorm(8, eps=1e-6)
    finally:
        torch.set_default_dtype(default)
    assert liger.weight.dtype == native.weight.dtype == torch.float32
    assert liger.casting_mode == "gemma"


def test_router_rounds_its_weights_to_the_input_dtype_as_native():
    """A bf16 input: the weights come back fp32 holding bf16 values, as natively (the fp32 logits of the native
    projection, the selection in the kernel)."""
    modeling = CASE.modeling_or_skip()
    from liger_dspine.models.ergo.modules import LigerErgoTopkRouter

    torch.manual_seed(0)
    native = modeling.ErgoTopkRouter(CASE.config())
    torch.nn.init.normal_(native.linear.weight, std=0.5)
    torch.nn.init.normal_(native.e_score_correction_bias, std=0.1)
    liger = copy.deepcopy(native)
    liger.__class__ = LigerErgoTopkRouter  # a subclass adding no state, as the instance patch converts it
    hidden = torch.randn(2, 8, native.linear.in_features).bfloat16()

    logits, weights, indices = liger(hidden)
    ref_logits, ref_weights, ref_indices = native(hidden)

    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=0)
    assert weights.dtype == torch.float32 and torch.equal(weights, weights.bfloat16().float())
    order, ref_order = indices.sort(dim=-1), ref_indices.sort(dim=-1)
    assert torch.equal(order.values, ref_order.values)
    torch.testing.assert_close(
        weights.gather(1, order.indices), ref_weights.gather(1, ref_order.indices), rtol=2**-8, atol=0
    )


def test_greedy_generation_with_the_cache_matches_native():
    """The cache of its sliding and full-attention layers goes through the patched forward as through the native."""
    native = CASE.build().eval()
    patched = copy.deepcopy(native)
    CASE.apply_fn()(model=patched, cross_entropy=True)
    input_ids = torch.randint(0, CASE.vocab_size, (2, 6), generator=torch.Generator().manual_seed(3))
    expected = native.generate(input_ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(patched.generate(input_ids, max_new_tokens=5, do_sample=False), expected)
