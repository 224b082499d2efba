"""The RoPE kernels in the layouts of DeepSeek-V2 ("pairs": each pair turned in place, the complex form) and of
MiniCPM3 / Mistral-Small-4 without rope_interleave ("halves": ``rotate_half``), against transformers' functions:
the query and key assembly of MLA and the plain rotation, forward and backward, in fp32."""

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from liger_dspine.ops.interleaved_rope import liger_interleaved_rope_single
from liger_dspine.ops.interleaved_rope import liger_mla_key
from liger_dspine.ops.interleaved_rope import liger_mla_query

B, H, S, NOPE, R, V = 2, 3, 5, 4, 6, 4


def angles(generator):
    """(cos, sin [B, S, R], cat(freqs, freqs) as transformers' rotary embeddings give them; freqs_cis [B, S, R/2])."""
    freqs = torch.rand(B, S, R // 2, generator=generator) * 6.0
    scale = 1.3  # an attention scaling, as YaRN sets it
    emb = torch.cat((freqs, freqs), dim=-1)
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs) * scale
    return emb.cos() * scale, emb.sin() * scale, freqs_cis


def native_rope(x: torch.Tensor, layout: str, cos, sin, freqs_cis) -> torch.Tensor:
    """x [B, H or 1, S, R] turned as transformers turns it in this layout."""
    if layout == "pairs":  # DeepSeek-V2's apply_rotary_emb
        turned = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2)) * freqs_cis.unsqueeze(1)
        return torch.view_as_real(turned).flatten(3).type_as(x)
    return apply_rotary_pos_emb(x, x, cos, sin)[0]


def angles_for(layout: str, cos, sin, freqs_cis):
    return (freqs_cis.real, freqs_cis.imag) if layout == "pairs" else (cos, sin)


@pytest.mark.parametrize("layout", ["pairs", "halves"])
def test_mla_query_and_key_match_native(layout):
    generator = torch.Generator().manual_seed(0)
    cos, sin, freqs_cis = angles(generator)
    q_states = torch.randn(B, S, H, NOPE + R, generator=generator).transpose(1, 2).requires_grad_()
    kv = torch.randn(B, S, H, NOPE + V, generator=generator).transpose(1, 2).requires_grad_()
    k_rot = torch.randn(B, 1, S, R, generator=generator).requires_grad_()
    kernel_angles = angles_for(layout, cos, sin, freqs_cis)

    query = liger_mla_query(q_states, *kernel_angles, R, layout)
    key, value = liger_mla_key(kv, k_rot, *kernel_angles, NOPE, layout)
    q_ref = torch.cat((q_states[..., :NOPE], native_rope(q_states[..., NOPE:], layout, cos, sin, freqs_cis)), -1)
    k_turned = native_rope(k_rot, layout, cos, sin, freqs_cis).expand(B, H, S, R)
    k_ref = torch.cat((kv[..., :NOPE], k_turned), -1)
    torch.testing.assert_close(query, q_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(key, k_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(value, kv[..., NOPE:])

    upstream = [torch.randn(t.shape, generator=generator) for t in (query, key, value)]
    ours = torch.autograd.grad((query, key, value), (q_states, kv, k_rot), upstream)
    ref = torch.autograd.grad((q_ref, k_ref, kv[..., NOPE:]), (q_states, kv, k_rot), upstream)
    for grad, ref_grad in zip(ours, ref):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["pairs", "halves"])
def test_single_rotation_matches_native(layout):
    generator = torch.Generator().manual_seed(1)
    cos, sin, freqs_cis = angles(generator)
    k_rot = torch.randn(B, 1, S, R, generator=generator).requires_grad_()
    turned = liger_interleaved_rope_single(k_rot, *angles_for(layout, cos, sin, freqs_cis), layout)
    ref = native_rope(k_rot, layout, cos, sin, freqs_cis)
    torch.testing.assert_close(turned, ref, rtol=1e-6, atol=1e-6)
    upstream = torch.randn(ref.shape, generator=generator)
    (grad,) = torch.autograd.grad(turned, k_rot, upstream)
    (ref_grad,) = torch.autograd.grad(ref, k_rot, upstream)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)


def test_an_unknown_layout_is_refused():
    x = torch.randn(1, 1, 2, 4)
    with pytest.raises(ValueError, match="liger-dspine: the rope layout must be one of interleaved, pairs, halves"):
        liger_interleaved_rope_single(x, torch.ones(1, 2, 4), torch.zeros(1, 2, 4), "complex")
