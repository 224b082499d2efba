"""Grouped key-value heads kept for the backward (models/dspine/grouped_saved_heads.py), and the Liger DSpine
attention that uses them, against the native attention that saves the repeats."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from liger_dspine.models.dspine import grouped_saved_heads
from liger_dspine.models.dspine.attention import DSpineAttention
from liger_dspine.models.dspine.attention import PreparedMask
from liger_dspine.models.dspine.attention import repeat_kv
from liger_dspine.models.dspine.grouped_saved_heads import saved_as_grouped
from liger_dspine.models.dspine.liger_attention import LigerDSpineAttention
from tiny_dspine import tiny_draft_config

GROUPS = 2


def _inputs(device="cpu", dtype=torch.float32, batch=2, heads=4, q_len=6, k_len=10, dim=8):
    generator = torch.Generator().manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, generator=generator).to(device, dtype).requires_grad_()

    query = leaf(batch, heads, q_len, dim)
    key = leaf(batch, heads // GROUPS, k_len, dim)
    value = leaf(batch, heads // GROUPS, k_len, dim)
    visible = torch.rand(batch, 1, q_len, k_len, generator=generator) > 0.3
    visible[..., 0] = True
    bias = torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, float("-inf")).to(device)
    return query, key, value, bias


def _attention(query, key, value, bias, hooked: bool, kernel: str):
    repeated_key, repeated_value = repeat_kv(key, GROUPS), repeat_kv(value, GROUPS)

    def run():
        if kernel == "sdpa":
            return F.scaled_dot_product_attention(query, repeated_key, repeated_value, attn_mask=bias)
        scores = query @ repeated_key.transpose(-1, -2) / query.shape[-1] ** 0.5 + bias
        return torch.softmax(scores, dim=-1) @ repeated_value

    if not hooked:
        return run()
    with saved_as_grouped(((repeated_key, key), (repeated_value, value)), GROUPS):
        return run()


def _grads(hooked: bool, kernel: str, wrap=None):
    query, key, value, bias = _inputs()
    fn = lambda q, k, v: _attention(q, k, v, bias, hooked, kernel)  # noqa: E731
    out = wrap(fn, query, key, value) if wrap else fn(query, key, value)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), query.grad, key.grad, value.grad


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
def test_grouped_heads_give_the_native_gradients(kernel, monkeypatch):
    regrouped = []
    unpack = grouped_saved_heads._GroupedHeads.unpack
    monkeypatch.setattr(grouped_saved_heads._GroupedHeads, "unpack", lambda self: regrouped.append(1) or unpack(self))
    native = _grads(False, kernel)
    hooked = _grads(True, kernel)
    assert regrouped, "the backward never read a tensor kept as grouped heads"
    for want, got in zip(native, hooked):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_inside_checkpointing_the_checkpoint_decides(monkeypatch):
    packed = []
    init = grouped_saved_heads._GroupedHeads.__init__
    monkeypatch.setattr(
        grouped_saved_heads._GroupedHeads, "__init__", lambda self, *a: packed.append(1) or init(self, *a)
    )
    wrap = lambda fn, *args: checkpoint(fn, *args, use_reentrant=False)  # noqa: E731
    native = _grads(False, "sdpa", wrap)
    hooked = _grads(True, "sdpa", wrap)
    assert not packed
    for want, got in zip(native, hooked):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_without_autograd_nothing_is_hooked():
    query, key, value, bias = _inputs()
    with torch.no_grad():
        assert not grouped_saved_heads.keeps_grouped(GROUPS)
        out = _attention(query, key, value, bias, True, "sdpa")
    torch.testing.assert_close(out, _attention(query, key, value, bias, False, "sdpa").detach())


def test_repeats_must_be_contiguous_repeats():
    _, key, _, _ = _inputs()
    with pytest.raises(ValueError, match="contiguous repeats"):
        with saved_as_grouped(((key, key),), GROUPS):
            pass


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("head_dim, tolerance", [(8, 1e-6), (16, 2e-5)])  # 16: the masked-attention kernel
def test_liger_attention_matches_native(implementation, head_dim, tolerance):
    config = tiny_draft_config(head_dim=head_dim)
    config._attn_implementation = implementation
    assert config.num_attention_heads > config.num_key_value_heads
    torch.manual_seed(0)
    native = DSpineAttention(config)
    liger = LigerDSpineAttention(config)
    liger.load_state_dict(native.state_dict())
    query, key, value, bias = _inputs(heads=config.num_attention_heads, dim=native.head_dim, batch=2, q_len=6, k_len=10)
    key = key.detach()[:, :1].expand(-1, config.num_key_value_heads, -1, -1).contiguous().requires_grad_()
    value = value.detach()[:, :1].expand(-1, config.num_key_value_heads, -1, -1).contiguous().requires_grad_()
    mask = PreparedMask(dense=torch.isfinite(bias[:1]))  # one mask for the batch, broadcast
    results = []
    for module in (native, liger):
        inputs = [t.detach().clone().requires_grad_() for t in (query, key, value)]
        out = module._attend(*inputs, mask)
        out.square().sum().backward()
        results.append((out.detach(), *(t.grad for t in inputs)))
    for want, got in zip(*results):
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_sdpa_keeps_only_the_grouped_heads():
    """bf16 sdpa with a mask (cuDNN's or the efficient kernel): the forward leaves the grouped heads, not the
    repeats, for the backward, and the gradients are the native ones."""
    shapes = dict(device="cuda", dtype=torch.bfloat16, batch=2, heads=32, q_len=1024, k_len=2048, dim=128)
    repeat_bytes = 2 * 2 * 32 * 2048 * 128 * 2  # key and value, repeated
    kept = {}
    grads = {}
    for hooked in (False, True):
        query, key, value, bias = _inputs(**shapes)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = _attention(query, key, value, bias, hooked, "sdpa")
        kept[hooked] = torch.cuda.memory_allocated() - before
        out.float().square().sum().backward()
        grads[hooked] = (query.grad, key.grad, value.grad)
        del out
    saved = kept[False] - kept[True]
    assert saved >= 0.9 * repeat_bytes, (kept, repeat_bytes)
    for want, got in zip(grads[False], grads[True]):  # the same kernels; their backward sums in any order
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-3)
