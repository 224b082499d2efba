"""Trailing RoPE (ops/trailing_rope.py) against DeepSeek-V4's own functions: its weightless per-head RMSNorm
(``DeepseekV4UnweightedRMSNorm``) and ``apply_rotary_pos_emb`` (pairs turned in place on the last R channels), with
the rotary embedding's half-sized tables; and the inverse turn of the attention output (``-sin``).

fp32 on a CPU through Triton's interpreter; bf16 on CUDA against the same functions in fp32.
"""

import pytest
import torch

from liger_dspine.ops.trailing_rope import liger_trailing_rope

modeling = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")


def native(x, cos, sin, eps):
    """V4's query path on x [B, S, N, D]: norm (optional), then RoPE on the [B, N, S, D] view."""
    if eps is not None:
        x = modeling.DeepseekV4UnweightedRMSNorm(eps=eps)(x)
    return modeling.apply_rotary_pos_emb(x.transpose(1, 2), cos, sin).transpose(1, 2)


def inputs(device, dtype, head_dim=32, rope_dim=8, batch=2, seq=5, heads=3, angle_batch=1, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, heads, seq, head_dim, generator=generator).transpose(1, 2)  # strided, as V4's q
    angles = torch.rand(angle_batch, seq, rope_dim // 2, generator=generator) * 6
    return x.to(device, dtype), angles.cos().to(device, dtype), angles.sin().to(device, dtype)


def run(fn, x, cos, sin, eps):
    leaf = x.detach().clone().requires_grad_(True)
    out = fn(leaf, cos, sin, eps)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(out.device, out.dtype)
    (out.float() * upstream.float()).sum().backward()
    return out.float(), leaf.grad.float()


@pytest.mark.parametrize("eps", [1e-6, None], ids=["norm", "rope_only"])
@pytest.mark.parametrize("angle_batch", [1, 2])
@pytest.mark.parametrize("head_dim, rope_dim", [(32, 8), (16, 16)])
def test_matches_v4_fp32(device, eps, angle_batch, head_dim, rope_dim):
    x, cos, sin = inputs(device, torch.float32, head_dim, rope_dim, angle_batch=angle_batch)
    out, grad = run(liger_trailing_rope, x, cos, sin, eps)
    ref, ref_grad = run(native, x, cos, sin, eps)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=1e-5)


def test_inverse_turn_undoes_the_turn(device):
    x, cos, sin = inputs(device, torch.float32)
    turned = liger_trailing_rope(x, cos, sin)
    torch.testing.assert_close(liger_trailing_rope(turned, cos, -sin), x.contiguous(), atol=1e-6, rtol=1e-5)


def test_bad_arguments_are_named(device):
    x, cos, sin = inputs(device, torch.float32)
    with pytest.raises(ValueError, match="power of two"):
        liger_trailing_rope(x[..., :24], cos, sin)
    with pytest.raises(ValueError, match="cos / sin"):
        liger_trailing_rope(x, cos[:, :3], sin[:, :3])
    with pytest.raises(ValueError, match="exceeds"):
        big = torch.zeros(1, x.shape[1], 20, device=device)
        liger_trailing_rope(x, big, big)


@pytest.mark.cuda
def test_cuda_bf16_against_fp32():
    x, cos, sin = inputs("cuda", torch.bfloat16, head_dim=512, rope_dim=64, batch=2, seq=300, heads=8)
    out, grad = run(liger_trailing_rope, x, cos, sin, 1e-6)
    ref, ref_grad = run(native, x.float(), cos.float(), sin.float(), 1e-6)
    for got, expected in ((out, ref), (grad, ref_grad)):
        assert ((got - expected).norm() / expected.norm()).item() < 1e-2


@pytest.mark.cuda
def test_cuda_offsets_past_two_to_the_31():
    """[1, 65536, 64, 512] heads (2^31 elements): the last positions against V4's functions (64-bit offsets)."""
    x = torch.randn(1, 65536, 64, 512, device="cuda", dtype=torch.bfloat16)
    angles = torch.rand(1, 65536, 32, device="cuda") * 6
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    out = liger_trailing_rope(x, cos, sin, eps=1e-6)
    last = slice(65536 - 8, 65536)
    expected = native(x[:, last].float(), cos[:, last].float(), sin[:, last].float(), 1e-6)
    assert ((out[:, last].float() - expected).norm() / expected.norm()).item() < 1e-2
