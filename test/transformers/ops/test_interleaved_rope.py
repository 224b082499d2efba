"""Interleaved partial RoPE kernels and LigerDeepseekV3Attention against transformers' DeepSeek-V3 code.

CPU runs go through Triton's interpreter in fp32: the kernels do the same fp32 products and sums as transformers'
eager code, so results agree to fp32 rounding (on CPU they are bit-equal; a GPU may contract to FMA).
"""

import pytest
import torch
from transformers.cache_utils import DynamicCache
from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

from liger_dspine.models.deepseek_v3 import attention as liger_attention
from liger_dspine.models.deepseek_v3.attention import LigerDeepseekV3Attention
from liger_dspine.models.deepseek_v3.attention import LigerDeepseekV3RecomputeAttention
from liger_dspine.ops.interleaved_rope import liger_interleaved_rope
from liger_dspine.ops.interleaved_rope import liger_mla_key
from liger_dspine.ops.interleaved_rope import liger_mla_query
from mla_attention import FP32
from mla_attention import assert_attention_grads_match
from mla_attention import attention_pair
from mla_attention import causal_mask
from mla_attention import cos_sin
from mla_attention import layout_position_ids
from mla_attention import model_pair
from mla_attention import run_attention
from mla_attention import vjp_grads
from tiny_models import tiny_attention_config

pytestmark = pytest.mark.matrix  # runs against every transformers version of the matrix


def test_transformers_cos_sin_carry_no_gradient(device):
    cos, sin = cos_sin(8, layout_position_ids("offset", 2, 5), device)
    assert not cos.requires_grad and not sin.requires_grad


@pytest.mark.parametrize("layout", ["contiguous", "offset", "packed"])
@pytest.mark.parametrize("seq_len, rope_dim", [(5, 8), (9, 16), (7, 6)])
def test_rope_matches_transformers(device, layout, seq_len, rope_dim):
    batch, heads, nope = 2, 3, 4
    torch.manual_seed(seq_len * rope_dim)
    cos, sin = cos_sin(rope_dim, layout_position_ids(layout, batch, seq_len), device, yarn=layout == "packed")
    # q as a strided slice of a [B, S, H, nope + R] projection, k as a slice of the compressed kv row.
    q_states = torch.randn(batch, seq_len, heads, nope + rope_dim, device=device).transpose(1, 2)
    q_states.requires_grad_()
    compressed = torch.randn(batch, seq_len, 16 + rope_dim, device=device, requires_grad=True)
    q = q_states[..., nope:]
    k = compressed[..., 16:].view(batch, 1, seq_len, rope_dim)
    assert not q.is_contiguous() and not k.is_contiguous()

    out = liger_interleaved_rope(q, k, cos, sin)
    ref = apply_rotary_pos_emb_interleave(q, k, cos, sin)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r, **FP32)
        if device == "cpu":
            assert torch.equal(o, r)

    grad_outputs = [torch.randn_like(r) for r in ref]
    grads = vjp_grads(out, (q_states, compressed), grad_outputs)
    ref_grads = vjp_grads(ref, (q_states, compressed), grad_outputs)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, **FP32)


def _native_query(q_states, cos, sin, rope_dim):
    nope = q_states.shape[-1] - rope_dim
    q_pass, q_rot = torch.split(q_states, [nope, rope_dim], dim=-1)
    q_rot, _ = apply_rotary_pos_emb_interleave(q_rot, q_rot[:, :1], cos, sin)
    return torch.cat((q_pass, q_rot), dim=-1)


def _native_key(kv, k_rot, cos, sin, nope):
    """transformers' rope of the shared key followed by expand_kv's assembly."""
    if cos is not None:
        _, k_rot = apply_rotary_pos_emb_interleave(k_rot, k_rot, cos, sin)
    k_nope, value = torch.split(kv, [nope, kv.shape[-1] - nope], dim=-1)
    key = torch.cat((k_nope, k_rot.expand(-1, kv.shape[1], -1, -1)), dim=-1)
    return key, value


@pytest.mark.parametrize("layout", ["contiguous", "packed"])
@pytest.mark.parametrize("nope", [0, 8])
def test_mla_query_matches_split_rope_cat(device, layout, nope):
    batch, heads, seq_len, rope_dim = 2, 3, 9, 8
    torch.manual_seed(nope)
    cos, sin = cos_sin(rope_dim, layout_position_ids(layout, batch, seq_len), device)
    q_states = torch.randn(batch, seq_len, heads * (nope + rope_dim), device=device, requires_grad=True)
    q_view = q_states.view(batch, seq_len, heads, nope + rope_dim).transpose(1, 2)

    query = liger_mla_query(q_view, cos, sin, rope_dim)
    ref = _native_query(q_view, cos, sin, rope_dim)
    assert query.shape == ref.shape
    assert query.transpose(1, 2).is_contiguous()  # stored [B, S, H, D]: attention output reshapes without a copy
    torch.testing.assert_close(query, ref, **FP32)

    grad = torch.randn_like(ref)
    (got,) = vjp_grads([query], [q_states], [grad])
    (want,) = vjp_grads([ref], [q_states], [grad])
    torch.testing.assert_close(got, want, **FP32)


@pytest.mark.parametrize("nope", [0, 8])
def test_mla_query_backward_in_the_gradient_it_gets(device, nope):
    """A query gradient laid out like q_states ([B, S, H, D] memory, as attention kernels give it) is turned in
    place and handed on: same numbers as the native split / rope / cat."""
    batch, heads, seq_len, rope_dim = 2, 3, 9, 8
    torch.manual_seed(10 + nope)
    cos, sin = cos_sin(rope_dim, layout_position_ids("packed", batch, seq_len), device)
    q_states = torch.randn(batch, seq_len, heads * (nope + rope_dim), device=device, requires_grad=True)
    q_view = q_states.view(batch, seq_len, heads, nope + rope_dim).transpose(1, 2)
    grad = torch.randn(batch, seq_len, heads, nope + rope_dim, device=device).transpose(1, 2)

    (want,) = torch.autograd.grad(_native_query(q_view, cos, sin, rope_dim), q_states, grad)
    incoming = grad.clone(memory_format=torch.preserve_format)
    (got,) = torch.autograd.grad(liger_mla_query(q_view, cos, sin, rope_dim), q_states, incoming)
    torch.testing.assert_close(got, want, **FP32)
    assert got.untyped_storage().data_ptr() == incoming.untyped_storage().data_ptr()  # no new full-size buffer


@pytest.mark.parametrize("rotate", [True, False])
def test_mla_key_matches_expand_kv(device, rotate):
    batch, heads, seq_len, nope, v_dim, rope_dim, lora = 2, 3, 7, 8, 12, 8, 16
    torch.manual_seed(int(rotate))
    cos, sin = cos_sin(rope_dim, layout_position_ids("packed", batch, seq_len), device) if rotate else (None, None)
    kv_flat = torch.randn(batch, seq_len, heads * (nope + v_dim), device=device, requires_grad=True)
    kv = kv_flat.view(batch, seq_len, heads, nope + v_dim).transpose(1, 2)
    compressed = torch.randn(batch, seq_len, lora + rope_dim, device=device, requires_grad=True)
    k_rot = compressed[..., lora:].view(batch, 1, seq_len, rope_dim)

    key, value = liger_mla_key(kv, k_rot, cos, sin, nope)
    ref_key, ref_value = _native_key(kv, k_rot, cos, sin, nope)
    assert key.transpose(1, 2).is_contiguous() and value.transpose(1, 2).is_contiguous()
    assert value.untyped_storage().data_ptr() != kv.untyped_storage().data_ptr()  # kv_b output not held by value
    torch.testing.assert_close(key, ref_key, **FP32)
    assert torch.equal(value, ref_value)

    grad_outputs = [torch.randn_like(ref_key), torch.randn_like(ref_value)]
    grads = vjp_grads([key, value], [kv_flat, compressed], grad_outputs)
    ref_grads = vjp_grads([ref_key, ref_value], [kv_flat, compressed], grad_outputs)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, **FP32)


def test_mla_key_value_only_loss(device):
    """A loss on the value alone: the key gradient is zero, the kv gradient is the value gradient."""
    batch, heads, seq_len, nope, v_dim, rope_dim = 1, 2, 3, 4, 4, 4
    kv_flat = torch.randn(batch, seq_len, heads * (nope + v_dim), device=device, requires_grad=True)
    kv = kv_flat.view(batch, seq_len, heads, nope + v_dim).transpose(1, 2)
    k_rot = torch.randn(batch, 1, seq_len, rope_dim, device=device, requires_grad=True)
    cos, sin = cos_sin(rope_dim, layout_position_ids("contiguous", batch, seq_len), device)
    _, value = liger_mla_key(kv, k_rot, cos, sin, nope)
    value.sum().backward()
    expected = torch.zeros_like(kv)
    expected[..., nope:] = 1.0
    assert torch.equal(kv_flat.grad, expected.transpose(1, 2).reshape_as(kv_flat))
    assert torch.equal(k_rot.grad, torch.zeros_like(k_rot))


def test_cos_sin_requiring_grad_is_refused(device):
    q = torch.randn(1, 2, 3, 4, device=device, requires_grad=True)
    cos, sin = cos_sin(4, layout_position_ids("contiguous", 1, 3), device)
    with pytest.raises(NotImplementedError):
        liger_interleaved_rope(q, q, cos.requires_grad_(), sin)


def _check_low_precision(device, dtype, batch, heads, seq_len, nope, rope_dim, v_dim, lora):
    """Query and key assembly in `dtype` against the fp32 eager computation on the same rounded inputs.

    The kernels compute in fp32 and round once, so each value sits within one ulp (finfo.eps relative) of the fp32
    result, and on average closer to it than transformers' eager code in `dtype`, which rounds after every product
    and sum. The rope-key gradient sums the heads: atol covers the fp32 reordering.
    """
    torch.manual_seed(0)
    cos, sin = cos_sin(rope_dim, layout_position_ids("offset", batch, seq_len), device, dtype=dtype)
    leaves = [
        torch.randn(batch, seq_len, heads * (nope + rope_dim), device=device, dtype=dtype),
        torch.randn(batch, seq_len, heads * (nope + v_dim), device=device, dtype=dtype),
        torch.randn(batch, seq_len, lora + rope_dim, device=device, dtype=dtype),
    ]
    grad_outputs = [
        torch.randn(batch, heads, seq_len, nope + rope_dim, device=device, dtype=dtype),
        torch.randn(batch, heads, seq_len, nope + rope_dim, device=device, dtype=dtype),
        torch.randn(batch, heads, seq_len, v_dim, device=device, dtype=dtype),
    ]

    def run(query_fn, key_fn, cast):
        """(query, key, value) and the gradients of the three leaves, computed in `cast`'s dtype, as fp32."""
        q_flat, kv_flat, compressed = [cast(t).requires_grad_() for t in leaves]
        q = q_flat.view(batch, seq_len, heads, nope + rope_dim).transpose(1, 2)
        kv = kv_flat.view(batch, seq_len, heads, nope + v_dim).transpose(1, 2)
        k_rot = compressed[..., lora:].view(batch, 1, seq_len, rope_dim)
        c, s = cast(cos), cast(sin)
        outputs = [query_fn(q, c, s, rope_dim), *key_fn(kv, k_rot, c, s, nope)]
        grads = vjp_grads(outputs, [q_flat, kv_flat, compressed], [cast(g) for g in grad_outputs])
        return [t.detach().float() for t in (*outputs, *grads)]

    got = run(liger_mla_query, liger_mla_key, lambda t: t.detach().clone())
    want = run(_native_query, _native_key, lambda t: t.detach().float())
    eager = run(_native_query, _native_key, lambda t: t.detach().clone())
    names = ["query", "key", "value", "grad q", "grad kv", "grad compressed kv"]
    for name, g, e, w in zip(names, got, eager, want):
        torch.testing.assert_close(
            g, w, atol=1e-3, rtol=torch.finfo(dtype).eps, msg=lambda m, name=name: f"{name}: {m}"
        )
        assert (g - w).abs().mean() <= (e - w).abs().mean(), name


def test_mla_kernels_fp16_round_once(device):
    """fp16 (right in the interpreter, unlike bf16): one rounding, closer to fp32 than the eager fp16 code."""
    _check_low_precision(device, torch.float16, batch=2, heads=8, seq_len=16, nope=8, rope_dim=8, v_dim=8, lora=8)


@pytest.mark.cuda
def test_mla_kernels_deepseek_widths_bf16_cuda():
    """DeepSeek-V3 head widths (128 heads, nope 128, rope 64, v 128) at 1024 positions, bf16."""
    _check_low_precision(
        "cuda", torch.bfloat16, batch=2, heads=128, seq_len=1024, nope=128, rope_dim=64, v_dim=128, lora=512
    )


@pytest.mark.cuda
def test_mla_kernels_deepseek_widths_fp32_cuda():
    """fp32 at DeepSeek-V3 widths; 1e-5 as the rope-key gradient sums 128 heads in another order."""
    batch, heads, seq_len, nope, rope_dim, v_dim, lora = 2, 128, 1024, 128, 64, 128, 512
    torch.manual_seed(0)
    device = "cuda"
    cos, sin = cos_sin(rope_dim, layout_position_ids("offset", batch, seq_len), device)
    q_flat = torch.randn(batch, seq_len, heads * (nope + rope_dim), device=device, requires_grad=True)
    kv_flat = torch.randn(batch, seq_len, heads * (nope + v_dim), device=device, requires_grad=True)
    compressed = torch.randn(batch, seq_len, lora + rope_dim, device=device, requires_grad=True)
    q = q_flat.view(batch, seq_len, heads, nope + rope_dim).transpose(1, 2)
    kv = kv_flat.view(batch, seq_len, heads, nope + v_dim).transpose(1, 2)
    k_rot = compressed[..., lora:].view(batch, 1, seq_len, rope_dim)

    out = [liger_mla_query(q, cos, sin, rope_dim), *liger_mla_key(kv, k_rot, cos, sin, nope)]
    ref = [_native_query(q, cos, sin, rope_dim), *_native_key(kv, k_rot, cos, sin, nope)]
    grad_outputs = [torch.randn_like(r) for r in ref]
    leaves = [q_flat, kv_flat, compressed]
    for got, want in zip(
        out + list(vjp_grads(out, leaves, grad_outputs)), ref + list(vjp_grads(ref, leaves, grad_outputs))
    ):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# ---- the attention module -----------------------------------------------------------------------------------


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("q_lora_rank", [None, 12])
@pytest.mark.parametrize("rope_interleave", [True, False])
@pytest.mark.parametrize("liger_class", [LigerDeepseekV3Attention, LigerDeepseekV3RecomputeAttention])
def test_attention_matches_native(device, q_lora_rank, attn_implementation, rope_interleave, liger_class):
    config = tiny_attention_config(q_lora_rank, attn_implementation, rope_interleave)
    native, liger = attention_pair(config, device, liger_class)
    assert liger.state_dict().keys() == native.state_dict().keys()
    batch, seq_len = 2, 9
    hidden = torch.randn(batch, seq_len, config.hidden_size, device=device, requires_grad=True)
    cos, sin = cos_sin(config.qk_rope_head_dim, layout_position_ids("packed", batch, seq_len), device)
    mask = causal_mask(batch, seq_len, seq_len, device)

    out = run_attention(liger, hidden, cos, sin, mask)
    ref = run_attention(native, hidden, cos, sin, mask)
    torch.testing.assert_close(out, ref, **FP32)

    assert_attention_grads_match(out, ref, hidden, liger, native, FP32)


@pytest.mark.parametrize("with_cache", [False, True])
def test_recompute_attention_keeps_less_for_backward(device, with_cache):
    """The recomputing class keeps at least the per-head query, key and value less for backward than the plain
    one (unique storages of the tensors autograd saves, parameters excluded), and its backward still runs; also
    with the cache transformers' models make in training (use_cache defaults to True)."""
    if with_cache and not liger_attention.LATENT_CACHE:
        pytest.skip("transformers < 5.17 caches expanded keys: no recompute with a cache")
    config = tiny_attention_config(q_lora_rank=12, attn_implementation="sdpa")
    batch, seq_len, heads = 1, 6, config.num_attention_heads
    hidden = torch.randn(batch, seq_len, config.hidden_size, device=device, requires_grad=True)
    cos, sin = cos_sin(config.qk_rope_head_dim, layout_position_ids("contiguous", batch, seq_len), device)
    mask = causal_mask(batch, seq_len, seq_len, device)

    def saved_bytes(liger_class):
        _, module = attention_pair(config, device, liger_class)
        parameters = {p.untyped_storage().data_ptr() for p in module.parameters()}
        storages = {}

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in parameters:
                storages[ptr] = t.untyped_storage().nbytes()
            return t

        cache = DynamicCache(config=config) if with_cache else None
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = run_attention(module, hidden, cos, sin, mask, cache=cache)
        out.sum().backward()
        assert all(p.grad is not None for p in module.parameters())
        return sum(storages.values())

    per_head = batch * heads * seq_len * (2 * config.qk_head_dim + config.v_head_dim) * hidden.element_size()
    assert saved_bytes(LigerDeepseekV3Attention) - saved_bytes(LigerDeepseekV3RecomputeAttention) >= per_head


def test_attention_class_level_construction_loads_native_weights(device):
    config = tiny_attention_config(q_lora_rank=12)
    native, _ = attention_pair(config, device)
    liger = LigerDeepseekV3Attention(config, layer_idx=0).to(device)
    liger.load_state_dict(native.state_dict())
    hidden = torch.randn(1, 5, config.hidden_size, device=device)
    cos, sin = cos_sin(config.qk_rope_head_dim, layout_position_ids("contiguous", 1, 5), device)
    mask = causal_mask(1, 5, 5, device)
    with torch.no_grad():
        torch.testing.assert_close(
            run_attention(liger, hidden, cos, sin, mask), run_attention(native, hidden, cos, sin, mask), **FP32
        )


@pytest.mark.parametrize("latent_cache", [True, False])
@pytest.mark.parametrize("cache_arg", ["cache", "past_key_values"])
def test_attention_with_cache_matches_native(device, monkeypatch, latent_cache, cache_arg):
    """Prefill then one decoding step, each module with its own cache; the cache may be passed by either name.

    ``latent_cache=False`` runs the branch for transformers < 5.17 (the cache holds expanded keys and values):
    its outputs must still equal the native ones.
    """
    monkeypatch.setattr(liger_attention.LigerDeepseekV3Attention, "latent_cache", latent_cache)
    config = tiny_attention_config(q_lora_rank=None)
    native, liger = attention_pair(config, device)
    batch, prefill = 2, 6
    hidden = torch.randn(batch, prefill + 1, config.hidden_size, device=device)
    positions = layout_position_ids("contiguous", batch, prefill + 1)
    cos, sin = cos_sin(config.qk_rope_head_dim, positions, device)
    native_cache, liger_cache = DynamicCache(), DynamicCache()
    with torch.no_grad():
        steps = [(slice(0, prefill), causal_mask(batch, prefill, prefill, device)), (slice(prefill, None), None)]
        for part, mask in steps:
            args = (hidden[:, part], cos[:, part], sin[:, part], mask)
            ref = run_attention(native, *args, cache=native_cache)
            out = run_attention(liger, *args, cache=liger_cache, cache_arg=cache_arg)
            torch.testing.assert_close(out, ref, **FP32)
    assert liger_cache.get_seq_length() == prefill + 1


def test_model_with_liger_attention_matches_native(device):
    """A whole two-layer model with every attention module swapped: loss and gradients match."""
    native, liger, config = model_pair(device, LigerDeepseekV3Attention)
    input_ids = torch.randint(0, config.vocab_size, (2, 8), device=device)
    losses = [m(input_ids=input_ids, labels=input_ids).loss for m in (native, liger)]
    torch.testing.assert_close(losses[1], losses[0], **FP32)
    for loss in losses:
        loss.backward()
    for (name, p), q in zip(native.named_parameters(), liger.parameters()):
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, **FP32, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_output_reaches_o_proj_without_a_copy(dtype):
    """Flash / cuDNN attention keep the [B, S, H, D] memory of the assembled query: the output then reshapes to
    [B, S, H * D] as a view, so o_proj saves the attention output itself and no copy of it."""
    batch, heads, seq_len, nope, v_dim, rope_dim = 1, 8, 256, 128, 128, 64
    cos, sin = cos_sin(rope_dim, layout_position_ids("contiguous", batch, seq_len), "cuda")
    q_states = torch.randn(batch, seq_len, heads * (nope + rope_dim), device="cuda", dtype=dtype)
    kv = torch.randn(batch, seq_len, heads * (nope + v_dim), device="cuda", dtype=dtype)
    k_rot = torch.randn(batch, 1, seq_len, rope_dim, device="cuda", dtype=dtype)
    query = liger_mla_query(q_states.view(batch, seq_len, heads, -1).transpose(1, 2), cos, sin, rope_dim)
    key, value = liger_mla_key(kv.view(batch, seq_len, heads, -1).transpose(1, 2), k_rot, cos, sin, nope)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True)
    flat = out.transpose(1, 2).reshape(batch, seq_len, -1)
    assert flat.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()


@pytest.mark.parametrize("rotate", [True, False])
def test_heads_split_over_programs(device, monkeypatch, rotate):
    """With a tile narrower than the heads, each row's heads spread over several programs (and the key backward's
    head sum stays in one): the query and key results are unchanged."""
    from liger_dspine.ops import interleaved_rope

    monkeypatch.setattr(interleaved_rope, "_TILE", 16)  # 1 head of 8 / 12 / 16 columns per tile, 3 heads per row
    test_mla_query_matches_split_rope_cat(device, "packed", 8)
    test_mla_key_matches_expand_kv(device, rotate)
