"""DeepSeek-V4's hyper-connections in liger-kernel's mHC kernels (``apply_liger_kernel_to_deepseek_v4(
hyper_connections=True)``) against the native layer: the coefficients of one ``DeepseekV4HyperConnection`` and the
mix around a block, then a training step of a tiny V4 with only that swap, against an fp64 native run; fp32 on a CPU
through Triton's interpreter."""

import copy
import sys
from pathlib import Path

import pytest
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from test_deepseek_v4_attention import distances  # noqa: E402
from test_deepseek_v4_attention import losses_and_grads  # noqa: E402

from tiny_family import CASES  # noqa: E402

CASE = CASES["deepseek_v4"]
ONLY_HYPER_CONNECTIONS = dict(
    fused_linear_cross_entropy=False,
    rms_norm=False,
    swiglu=False,
    moe_router=False,
    grouped_experts=False,
    rope=False,
    hyper_connections=True,
    indexer=False,
)


def build_pair():
    native = CASE.build()
    with torch.no_grad():  # away from the initial values (scale 1), so that a scale mixed up would show
        for module in native.modules():
            if hasattr(module, "hc_sinkhorn_iters"):
                module.scale.uniform_(0.5, 1.5)
                module.base.normal_(0.0, 0.5)
    patched = copy.deepcopy(native)
    CASE.apply_fn()(model=patched, **ONLY_HYPER_CONNECTIONS)
    return native, patched


def loaded_in_bf16(model):
    """``model`` in bf16 but for the parameters transformers keeps in fp32 when it loads V4 in bf16."""
    keep = set(model._keep_in_fp32_modules_strict)
    model.bfloat16()
    for name, param in model.named_parameters():
        if keep & set(name.split(".")):
            param.data = param.data.float()
    return model


def test_coefficients_and_mix_match_the_native_connection():
    from liger_dspine.models.deepseek_v4.hyper_connections import _coefficients
    from liger_dspine.models.deepseek_v4.hyper_connections import _mix

    native, _ = build_pair()
    layer = CASE.decoder_of(native).layers[1]
    streams = torch.randn(2, 7, CASE.config().hc_mult, CASE.config().hidden_size)
    post, comb, collapsed = layer.attn_hc(streams)
    pre, liger_post, liger_comb = _coefficients(layer.attn_hc, streams)
    torch.testing.assert_close(liger_post, post, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(liger_comb, comb, atol=1e-6, rtol=1e-5)

    block = torch.nn.Linear(streams.shape[-1], streams.shape[-1])
    expected = post.unsqueeze(-1) * block(collapsed).unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams)
    torch.testing.assert_close(_mix(streams, block, layer.attn_hc, torch.nn.Identity()), expected, atol=1e-5, rtol=1e-5)


def test_training_step_matches_native(monkeypatch):
    from liger_dspine.models.deepseek_v4 import hyper_connections
    from liger_dspine.models.deepseek_v4.hyper_connections import LigerDeepseekV4DecoderLayer

    native, patched = build_pair()
    layers = CASE.decoder_of(patched).layers
    assert all(type(layer) is LigerDeepseekV4DecoderLayer for layer in layers)
    calls, original = [], hyper_connections.liger_mhc_coefficients
    monkeypatch.setattr(
        hyper_connections, "liger_mhc_coefficients", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    input_ids = torch.randint(0, CASE.vocab_size, (2, 12), generator=torch.Generator().manual_seed(5))
    patched_run = losses_and_grads(patched, input_ids)
    assert len(calls) == 2 * len(layers)  # both mixes of every layer ran the kernels
    reference = copy.deepcopy(native).double()
    reference.set_experts_implementation("eager")
    exact = losses_and_grads(reference, input_ids)
    native_errors = distances(losses_and_grads(native, input_ids), exact, whole=True)
    patched_errors = distances(patched_run, exact, whole=True)
    assert patched_errors["whole"] <= max(1e-6, 2 * native_errors["whole"]), (native_errors, patched_errors)
    # Each tensor against native's error on it: gradients whose terms cancel (the untouched hc_head's are one) amplify
    # every upstream rounding, in both runs, by far more than the others.
    worse = {name: (error, native_errors[name]) for name, error in patched_errors.items()}
    assert all(error <= max(1e-5, 8 * native) for error, native in worse.values()), worse
    for name in ("fn", "base", "scale"):  # the connections' own parameters get their gradients
        assert all(patched_run[1][f"model.layers.{i}.attn_hc.{name}"].abs().max() > 0 for i in range(len(layers)))


def test_compiled_layer_runs_the_native_forward(monkeypatch):
    """liger-kernel's mHC functions are no registered ops: under torch.compile the layer is the native one."""
    _, patched = build_pair()
    layer = CASE.decoder_of(patched).layers[0]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not layer._liger_applies(torch.zeros(1))


@pytest.mark.cuda
def test_cuda_bf16_training_step_close_to_fp32():
    """bf16 as transformers loads V4 (the connections and norms kept in fp32), native and patched, against an fp32
    run of the same weights: the whole gradient and the loss about as close as native's, and no parameter's gradient
    far off."""
    native, _ = build_pair()
    reference = copy.deepcopy(native).cuda()
    native = loaded_in_bf16(native)
    assert CASE.decoder_of(native).layers[0].attn_hc.fn.dtype == torch.float32
    reference.load_state_dict(native.state_dict())  # the same (rounded) weights, in fp32
    patched = copy.deepcopy(native)
    CASE.apply_fn()(model=patched, **ONLY_HYPER_CONNECTIONS)
    native, patched = native.cuda(), patched.cuda()
    input_ids = torch.randint(0, CASE.vocab_size, (2, 64), generator=torch.Generator().manual_seed(3)).cuda()
    exact = losses_and_grads(reference, input_ids)
    try:
        native_run = losses_and_grads(native, input_ids)
    except RuntimeError as error:  # transformers 5.17's V4 feeds the fp32 connections' output to bf16 projections
        if "same dtype" not in str(error):
            raise
        pytest.skip(f"transformers {transformers.__version__}'s own DeepSeek-V4 does not run loaded in bf16: {error}")
    native_errors = distances(native_run, exact, whole=True)
    liger_errors = distances(losses_and_grads(patched, input_ids), exact, whole=True)
    report = {name: (round(native_errors[name], 4), round(liger_errors[name], 4)) for name in native_errors}
    for name in ("whole", "loss"):
        assert liger_errors[name] <= max(1.25 * native_errors[name], 2**-7), report
    # one parameter's bf16 error scatters (the tiny model's gradients are sums of few terms); a wrong gradient is off
    # by its own size (error about 1)
    for name in native_errors:
        assert liger_errors[name] <= max(4 * native_errors[name], 2**-3), (name, report)


def test_hyper_head_matches_native_forward_and_backward():
    """The final collapse of the streams: output and the gradients of the streams and of hc_fn / hc_base / hc_scale
    against the native head, fp32 (fp64 reference)."""
    from liger_dspine.models.deepseek_v4.hyper_connections import LigerDeepseekV4HyperHead

    native, patched = build_pair()
    head, liger_head = native.model.hc_head, patched.model.hc_head
    assert type(liger_head) is LigerDeepseekV4HyperHead
    with torch.no_grad():  # away from the initial values, so that a scale or bias mixed up would show
        for module in (head, liger_head):
            torch.manual_seed(3)
            module.hc_scale.uniform_(0.5, 1.5)
            module.hc_base.normal_(0.0, 0.5)
            module.hc_fn.normal_(0.0, 0.1)
    streams = torch.randn(
        2, 7, CASE.config().hc_mult, CASE.config().hidden_size, generator=torch.Generator().manual_seed(6)
    )
    grad = torch.randn(2, 7, CASE.config().hidden_size, generator=torch.Generator().manual_seed(8))
    runs = []
    for module, dtype in ((head.double(), torch.float64), (liger_head, torch.float32)):
        x = streams.to(dtype).requires_grad_()
        module.zero_grad()
        out = module(x)
        (out * grad.to(dtype)).sum().backward()
        runs.append([out, x.grad] + [p.grad for p in (module.hc_fn, module.hc_base, module.hc_scale)])
    for name, expected, got in zip(("out", "d x", "d hc_fn", "d hc_base", "d hc_scale"), *runs):
        assert got.abs().sum() > 0, name
        torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
