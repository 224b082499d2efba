"""Backward kernels compiled while the forward runs (ops/precompile.py): on CUDA, after an op's forward and the
background work, its backward must launch without compiling anything, i.e. the forward asked for exactly the
specialisation the backward uses. On a CPU the helper does nothing."""

import pytest
import torch

from liger_dspine.ops import mhc_coefficients
from liger_dspine.ops import mhc_projection
from liger_dspine.ops import mhc_streams
from liger_dspine.ops import precompile
from liger_dspine.ops import sink_attention
from liger_dspine.ops import trailing_rope


def _cached(kernel) -> int:
    return sum(len(caches[0]) for caches in kernel.device_caches.values())


def _sink(device):
    q = torch.randn(1, 4, 40, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    kv = torch.randn(1, 50, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    sinks = torch.zeros(4, device=device, requires_grad=True)
    mask = torch.zeros(1, 1, 40, 40, device=device)
    bias = torch.zeros(1, 1, 40, 11, device=device)[..., :10]  # a slice, as V4's CSA bias
    out = sink_attention.liger_sink_attention(q, kv, sinks, 8, 0.125, mask=mask, bias=bias)
    return out, (sink_attention._sink_attention_dq_kernel, sink_attention._sink_attention_dkv_kernel)


def _rope(device):
    x = torch.randn(1, 40, 4, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = torch.randn(1, 40, 8, device=device), torch.randn(1, 40, 8, device=device)
    out = trailing_rope.liger_trailing_rope(x, cos, sin, eps=1e-6) + trailing_rope.liger_trailing_rope(x, cos, -sin)
    return out, (trailing_rope._trailing_rope_backward_kernel,)


def _mhc(device):
    streams = torch.randn(2, 20, 4, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
    fn = torch.randn(24, 1024, device=device, requires_grad=True)
    base, scale = torch.randn(24, device=device, requires_grad=True), torch.ones(3, device=device, requires_grad=True)
    pre, post, comb = mhc_coefficients.liger_mhc_coefficients(streams, fn, base, scale, 20, 1e-6, 1e-6, 1e-6)
    block = mhc_streams.liger_mhc_collapse(streams, pre)
    out = mhc_streams.liger_mhc_mix(streams, block * 2, post, comb)
    kernels = (
        mhc_projection._mhc_projection_backward_kernel,
        mhc_coefficients._mhc_sinkhorn_backward_kernel,
        mhc_streams._mhc_collapse_backward_kernel,
        mhc_streams._mhc_mix_backward_kernel,
    )
    return out, kernels


@pytest.mark.cuda
@pytest.mark.parametrize("case", [_sink, _rope, _mhc], ids=["sink_attention", "trailing_rope", "mhc"])
def test_backward_compiles_nothing_after_the_forward(case):
    out, kernels = case("cuda")
    precompile.wait()
    before = [_cached(k) for k in kernels]
    assert all(before), "the forward precompiled no backward kernel"
    out.float().square().sum().backward()
    torch.cuda.synchronize()
    assert [_cached(k) for k in kernels] == before, "the backward compiled a variant the forward did not ask for"


@pytest.mark.parametrize("cuda, flag", [(False, "1"), (True, "0")], ids=["no_cuda", "turned_off"])
def test_nothing_is_submitted_without_cuda_or_when_turned_off(cuda, flag, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setenv("LIGER_DSPINE_PRECOMPILE", flag)
    monkeypatch.setattr(precompile, "_pool", lambda: pytest.fail("a compilation was submitted"))
    precompile.precompile(sink_attention._sink_attention_dq_kernel, torch.zeros(1), 3, HEAD_DIM=64)


def test_submits_once_per_specialisation(monkeypatch):
    submitted = []

    class Pool:
        def submit(self, *args):
            submitted.append(args)
            return type("Done", (), {"result": lambda self: None})()

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setenv("LIGER_DSPINE_PRECOMPILE", "1")
    monkeypatch.setattr(precompile, "_pool", lambda: Pool())
    monkeypatch.setattr(precompile, "_submitted", set())
    kernel = sink_attention._sink_attention_dkv_kernel
    for value in (32, 48, 7, 1):  # 32 and 48 specialise alike (multiples of 16), 7 and 1 each differently
        precompile.precompile(kernel, torch.zeros(1, dtype=torch.bfloat16), value, HEAD_DIM=64)
    precompile.precompile(kernel, torch.zeros(1), 32, HEAD_DIM=64)  # another dtype
    assert len(submitted) == 4
    assert submitted[0][3] == [torch.bfloat16, 32]  # tensors stand in as their dtype
    precompile.wait()
