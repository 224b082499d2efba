"""DeepSeek-V3 with ``qk_nope_head_dim=0``: every key and query column is rotary. transformers runs it; the patched
model gives the native logits, loss and gradients (fp32, tolerance 1e-5: rounding of differently ordered kernels),
with eager or sdpa attention, and with sdpa one head at a time (the head-grouped attention, its budget cut to 1 byte).
"""

import copy

import pytest
import torch

from liger_dspine import apply_liger_kernel_to_deepseek_v3
from liger_dspine.models.deepseek_v3 import head_groups
from liger_dspine.models.deepseek_v3.attention import LigerDeepseekV3Attention
from liger_dspine.ops.interleaved_rope import liger_mla_key
from tiny_models import assert_grads_close
from tiny_models import build_model
from tiny_models import loss_and_grads
from tiny_models import random_batch
from tiny_models import tiny_deepseek_v3_config

FP32 = dict(atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "attn_implementation, head_grouped",
    [("eager", False), ("sdpa", False), ("sdpa", True)],
    ids=["eager", "sdpa", "grouped"],
)
def test_patched_model_matches_native_without_a_non_rotary_part(monkeypatch, attn_implementation, head_grouped):
    grouped_calls = []
    if head_grouped:
        monkeypatch.setattr(head_groups, "KEPT_GROUP_BYTES", 1)
        grouped = LigerDeepseekV3Attention._liger_head_grouped
        monkeypatch.setattr(
            LigerDeepseekV3Attention, "_liger_head_grouped", lambda *a: grouped_calls.append(a[-1]) or grouped(*a)
        )
    config = tiny_deepseek_v3_config(qk_nope_head_dim=0, attn_implementation=attn_implementation)
    native = build_model(config).train()
    patched = copy.deepcopy(native)
    apply_liger_kernel_to_deepseek_v3(model=patched)
    assert sum(isinstance(m, LigerDeepseekV3Attention) for m in patched.modules()) == config.num_hidden_layers
    input_ids, labels = random_batch(config)

    expected, expected_grads = loss_and_grads(native, input_ids, labels=labels)
    actual, actual_grads = loss_and_grads(patched, input_ids, labels=labels)
    torch.testing.assert_close(actual.loss, expected.loss, **FP32)
    assert_grads_close(actual_grads, expected_grads, **FP32)
    assert grouped_calls == ([1] * config.num_hidden_layers if head_grouped else [])  # one head per group

    native.eval(), patched.eval()
    with torch.no_grad():
        torch.testing.assert_close(patched(input_ids).logits, native(input_ids).logits, **FP32)


def test_key_assembly_without_a_non_rotary_part_matches_torch():
    """liger_mla_key with nope_dim 0: the key is the turned k_rot on every head, the value all of kv."""
    batch, heads, seq_len, rope_dim, value_dim = 2, 3, 5, 8, 6
    torch.manual_seed(0)
    kv = torch.randn(batch, heads, seq_len, value_dim, requires_grad=True)
    k_rot = torch.randn(batch, 1, seq_len, rope_dim, requires_grad=True)
    angles = torch.rand(1, seq_len, rope_dim // 2) * 3
    cos, sin = angles.cos().repeat(1, 1, 2), angles.sin().repeat(1, 1, 2)
    key, value = liger_mla_key(kv, k_rot, cos, sin, 0)

    pairs = k_rot.view(batch, 1, seq_len, rope_dim // 2, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    c, s = cos[..., : rope_dim // 2].unsqueeze(1), sin[..., : rope_dim // 2].unsqueeze(1)
    expected_key = torch.cat((even * c - odd * s, odd * c + even * s), dim=-1).expand(-1, heads, -1, -1)
    torch.testing.assert_close(key, expected_key, **FP32)
    torch.testing.assert_close(value, kv, atol=0, rtol=0)

    grad_key, grad_value = torch.randn_like(key), torch.randn_like(value)
    torch.autograd.backward((key, value), (grad_key, grad_value))
    expected_kv_grad = grad_value
    (expected_rot_grad,) = torch.autograd.grad(expected_key, k_rot, grad_key)
    torch.testing.assert_close(kv.grad, expected_kv_grad, atol=0, rtol=0)
    torch.testing.assert_close(k_rot.grad, expected_rot_grad, **FP32)
