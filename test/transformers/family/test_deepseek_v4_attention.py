"""DeepSeek-V4's attention with the sink-attention kernel (``apply_liger_kernel_to_deepseek_v4(rope=True)``)
against the native eager attention: a tiny V4 with one layer of each kind (sliding window, CSA with its indexer,
HCA), 20 tokens (window 4, compression rates 2 and 4: 10 and 5 compressed entries), fp32 on a CPU through Triton's
interpreter. Only the attention is swapped, so the runs differ by its kernel alone."""

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tiny_family import CASES  # noqa: E402

CASE = CASES["deepseek_v4"]
ONLY_ATTENTION = dict(
    fused_linear_cross_entropy=False,
    rms_norm=False,
    swiglu=False,
    moe_router=False,
    grouped_experts=False,
    hyper_connections=False,
    indexer=False,
)


def build_pair():
    native = CASE.build()
    patched = copy.deepcopy(native)
    CASE.apply_fn()(model=patched, rope=True, **ONLY_ATTENTION)
    return native, patched


def losses_and_grads(model, input_ids):
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_every_attention_is_swapped_and_the_rest_kept():
    from liger_dspine.models.deepseek_v4.attention import LigerDeepseekV4Attention

    native, patched = build_pair()
    layers = CASE.decoder_of(patched).layers
    assert [type(layer.self_attn) for layer in layers] == [LigerDeepseekV4Attention] * len(layers)
    assert [layer.self_attn.layer_type for layer in layers] == CASE.config().layer_types
    kept = {type(m).__name__ for m in patched.modules()} - {"LigerDeepseekV4Attention"}
    assert kept == {type(m).__name__ for m in native.modules()} - {"DeepseekV4Attention"}


def count_kernel_calls(monkeypatch) -> list:
    """The shapes (q, kv, bias) of each call of the sink-attention op."""
    from liger_dspine.ops import sink_attention

    calls, original = [], sink_attention.liger_sink_attention

    def counted(q, kv, *args, bias=None, **kwargs):
        calls.append((tuple(q.shape), tuple(kv.shape), None if bias is None else tuple(bias.shape)))
        return original(q, kv, *args, bias=bias, **kwargs)

    monkeypatch.setattr(sink_attention, "liger_sink_attention", counted)
    return calls


def test_training_step_matches_native(monkeypatch):
    native, patched = build_pair()
    calls = count_kernel_calls(monkeypatch)
    input_ids = torch.randint(0, CASE.vocab_size, (2, 20), generator=torch.Generator().manual_seed(3))
    patched_run = losses_and_grads(patched, input_ids)
    # every layer ran the kernel: the sliding layer without compressed entries, CSA with 10, HCA with 5
    assert calls == [
        ((2, 4, 20, 16), (2, 20, 16), None),
        ((2, 4, 20, 16), (2, 30, 16), (2, 1, 20, 10)),
        ((2, 4, 20, 16), (2, 25, 16), (2, 1, 20, 5)),
    ]
    # as the family's V4 parity test: against an fp64 native run, no further than 4x native fp32 (fp32 rounding of
    # V4's hyper-connections reaches 2e-4 relative on a few tiny gradient entries, whatever computes the attention)
    reference = copy.deepcopy(native).double()
    reference.set_experts_implementation("eager")  # torch's grouped GEMM has no fp64
    exact = losses_and_grads(reference, input_ids)
    native_errors, patched_errors = distances(losses_and_grads(native, input_ids), exact), distances(patched_run, exact)
    assert max(patched_errors.values()) <= max(1e-5, 4 * max(native_errors.values())), (native_errors, patched_errors)
    sinks = [n for n in patched_run[1] if n.endswith("self_attn.sinks")]
    assert len(sinks) == 3 and all(patched_run[1][n].abs().max() > 0 for n in sinks)


def distances(run, exact, whole: bool = False) -> dict[str, float]:
    """Relative error of the loss and of each gradient against the reference run; with ``whole``, also that of all
    the gradients as one vector."""
    (loss, grads), (ref_loss, ref_grads) = run, exact
    errors = {"loss": abs(loss.double() - ref_loss.double()).item() / abs(ref_loss.double()).item()}
    for name, ref in ref_grads.items():
        if ref.any():
            errors[name] = ((grads[name].double() - ref.double()).norm() / ref.double().norm()).item()
    if whole:
        squared = sum((grads[n].double() - r.double()).square().sum() for n, r in ref_grads.items())
        errors["whole"] = (squared / sum(r.double().square().sum() for r in ref_grads.values())).sqrt().item()
    return errors


def test_generation_prefills_with_the_kernel_and_decodes_natively(monkeypatch):
    """Generation: the prefill (no past) runs the kernel and fills the cache as the native forward does; the decoding
    steps (a past) run the native attention. The same tokens as the unpatched model."""
    native, patched = build_pair()
    calls = count_kernel_calls(monkeypatch)
    input_ids = torch.randint(0, CASE.vocab_size, (1, 9), generator=torch.Generator().manual_seed(4))
    native.eval(), patched.eval()
    with torch.no_grad():
        expected = native.generate(input_ids, max_new_tokens=3, do_sample=False)
        got = patched.generate(input_ids, max_new_tokens=3, do_sample=False)
    assert torch.equal(got, expected)
    assert [q for q, _, _ in calls] == [(1, 4, 9, 16)] * 3  # the prefill of each layer only


def test_revert_restores_the_native_attention():
    from liger_dspine import revert_liger_kernel_to_deepseek_v4

    native, patched = build_pair()
    revert_liger_kernel_to_deepseek_v4(model=patched)
    assert {type(m) for m in patched.modules()} == {type(m) for m in native.modules()}


@pytest.mark.cuda
def test_cuda_bf16_training_step_close_to_fp32():
    """bf16 on CUDA: the patched model's loss and gradients against an fp32 native run of the same weights, no further
    than the native bf16 model's (the kernel computes scores and softmax in fp32, the eager path in bf16)."""
    native, patched = build_pair()
    reference = copy.deepcopy(native).cuda()
    native, patched = native.cuda().bfloat16(), patched.cuda().bfloat16()
    input_ids = torch.randint(0, CASE.vocab_size, (2, 64), generator=torch.Generator().manual_seed(3)).cuda()
    ref_loss, ref_grads = losses_and_grads(reference, input_ids)

    def error(run):
        loss, grads = run
        flat = torch.cat([grads[n].float().flatten() for n in ref_grads])
        ref_flat = torch.cat([g.flatten() for g in ref_grads.values()])
        return abs(loss.float() - ref_loss).item() / abs(ref_loss).item(), (
            (flat - ref_flat).norm() / ref_flat.norm()
        ).item()

    native_error, liger_error = error(losses_and_grads(native, input_ids)), error(losses_and_grads(patched, input_ids))
    assert liger_error[0] <= max(1.25 * native_error[0], 2**-7), (native_error, liger_error)
    assert liger_error[1] <= max(1.25 * native_error[1], 2**-7), (native_error, liger_error)


def test_attention_weights_requested_run_the_native_attention(monkeypatch):
    native, patched = build_pair()
    calls = count_kernel_calls(monkeypatch)
    input_ids = torch.randint(0, CASE.vocab_size, (2, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = native.eval()(input_ids=input_ids, output_attentions=True)
        actual = patched.eval()(input_ids=input_ids, output_attentions=True)
    assert calls == []  # the kernel keeps no weights: every layer ran transformers' attention
    assert len(actual.attentions) == len(expected.attentions) == len(CASE.decoder_of(native).layers)
    for got, want in zip(actual.attentions, expected.attentions):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(actual.logits, expected.logits, atol=0, rtol=0)
