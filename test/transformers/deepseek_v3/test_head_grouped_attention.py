"""``recompute_attention``'s head-grouped recompute against transformers' DeepSeek-V3 attention.

The recompute walks the heads a group at a time in both passes; the group size is set small here (one head, and
groups that do not divide the head count) so that the grouping, not a single group, is what gets compared.
"""

import pytest
import torch
from transformers.cache_utils import DynamicCache

from liger_dspine.models.deepseek_v3 import attention as liger_attention
from liger_dspine.models.deepseek_v3 import head_groups
from liger_dspine.models.deepseek_v3.attention import LigerDeepseekV3Attention
from liger_dspine.models.deepseek_v3.attention import LigerDeepseekV3RecomputeAttention
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

# The latents' gradients sum the heads group by group: fp32 rounding of another summation order.
GROUPED = dict(atol=1e-5, rtol=1e-4)

pytestmark = [
    pytest.mark.matrix,
    pytest.mark.skipif(
        not liger_attention.LATENT_CACHE,
        reason="head-grouped recompute needs the latent cache (transformers >= 5.17)",
    ),
]


def _group_bytes_for(heads: int, config, tokens: int, element_size: int = 4) -> int:
    return heads * tokens * (2 * config.qk_head_dim + 2 * config.v_head_dim) * element_size


def _inputs(config, device, batch, seq_len, layout="packed"):
    hidden = torch.randn(batch, seq_len, config.hidden_size, device=device, requires_grad=True)
    cos, sin = cos_sin(config.qk_rope_head_dim, layout_position_ids(layout, batch, seq_len), device)
    return hidden, cos, sin, causal_mask(batch, seq_len, seq_len, device)


@pytest.mark.slow  # every head grouping against native, 24 ways: minutes on the interpreter: make test-slow
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("q_lora_rank", [None, 12])
@pytest.mark.parametrize("with_cache", [False, True])
@pytest.mark.parametrize("liger_class", [LigerDeepseekV3RecomputeAttention, LigerDeepseekV3Attention])
def test_head_grouped_matches_native(device, monkeypatch, group, q_lora_rank, with_cache, liger_class):
    """Both modes: the recompute, and the plain class's kept per-group graphs (long sequences)."""
    config = tiny_attention_config(q_lora_rank, "sdpa")
    batch, seq_len = 2, 9
    # the largest power of two under the budget: 3 -> groups of 2, 2 (the head count is 4); 1 and 4 as they are
    budget = _group_bytes_for(group, config, batch * seq_len)
    monkeypatch.setattr(head_groups, "RECOMPUTE_GROUP_BYTES", budget)
    monkeypatch.setattr(head_groups, "KEPT_GROUP_BYTES", budget)
    native, liger = attention_pair(config, device, liger_class)
    assert liger._liger_head_groups_apply()
    hidden, cos, sin, mask = _inputs(config, device, batch, seq_len)

    cache = DynamicCache(config=config) if with_cache else None
    out = run_attention(liger, hidden, cos, sin, mask, cache=cache)
    grouped = liger_class is LigerDeepseekV3RecomputeAttention or group < config.num_attention_heads
    assert (type(out.grad_fn).__name__ == "LigerHeadGroupedAttentionFunctionBackward") == grouped
    ref = run_attention(native, hidden, cos, sin, mask, cache=DynamicCache(config=config) if with_cache else None)
    torch.testing.assert_close(out, ref, **FP32)

    assert_attention_grads_match(out, ref, hidden, liger, native, GROUPED)


def test_kept_groups_free_each_graph_in_backward(device, monkeypatch):
    """The plain class's per-group graphs are released group by group: a second backward through them fails
    with an error that says so instead of returning wrong gradients."""
    config = tiny_attention_config(12, "sdpa")
    monkeypatch.setattr(head_groups, "KEPT_GROUP_BYTES", _group_bytes_for(1, config, 2 * 9))
    _, liger = attention_pair(config, device, LigerDeepseekV3Attention)
    hidden, cos, sin, mask = _inputs(config, device, 2, 9)
    out = run_attention(liger, hidden, cos, sin, mask)
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second time"):
        out.sum().backward()


def test_heads_per_group_is_a_power_of_two_under_the_budget():
    assert head_groups.heads_per_group(128, tokens=10, per_token_head_bytes=10, budget=1000) == 8  # 10 fit
    assert head_groups.heads_per_group(4, tokens=10, per_token_head_bytes=10, budget=1000) == 4  # capped at H
    assert head_groups.heads_per_group(128, tokens=1000, per_token_head_bytes=10, budget=1000) == 1  # none fit
    # DeepSeek-V3 widths in bf16 with the shipped budgets
    per_token_head = (2 * 192 + 2 * 128) * 2
    recompute, kept = head_groups.RECOMPUTE_GROUP_BYTES, head_groups.KEPT_GROUP_BYTES
    assert head_groups.heads_per_group(128, 16384, per_token_head, recompute) == 8
    assert head_groups.heads_per_group(128, 4096, per_token_head, recompute) == 32
    assert head_groups.heads_per_group(128, 8192, per_token_head, kept) == 128  # one group: the plain path
    assert head_groups.heads_per_group(128, 16384, per_token_head, kept) == 64
    assert head_groups.heads_per_group(128, 32768, per_token_head, kept) == 32


def test_head_grouped_keeps_only_latents(device):
    """Nothing per head is kept for backward: against the plain class, the saved tensors shrink by at least the
    query, key, value and attention output (``o_proj``'s input) of every head."""
    config = tiny_attention_config(q_lora_rank=12, attn_implementation="sdpa")
    batch, seq_len, heads = 1, 6, config.num_attention_heads
    hidden, cos, sin, mask = _inputs(config, device, batch, seq_len, layout="contiguous")

    def saved_bytes(liger_class):
        _, module = attention_pair(config, device, liger_class)
        parameters = {p.untyped_storage().data_ptr() for p in module.parameters()}
        storages = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in parameters:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = run_attention(module, hidden, cos, sin, mask)
        out.sum().backward()
        assert all(p.grad is not None for p in module.parameters())
        return sum(storages.values())

    per_head = batch * heads * seq_len * (2 * config.qk_head_dim + 2 * config.v_head_dim) * hidden.element_size()
    assert saved_bytes(LigerDeepseekV3Attention) - saved_bytes(LigerDeepseekV3RecomputeAttention) >= per_head


def _wrapped_linear(linear):
    class Adapter(torch.nn.Module):  # stands for a LoRA-style wrapper: not a plain Linear
        def __init__(self):
            super().__init__()
            self.base = linear
            self.weight = linear.weight
            self.bias = None

        def forward(self, x):
            return self.base(x)

    return Adapter()


@pytest.mark.parametrize("case", ["eager", "dropout", "wrapped_o_proj", "hooked_o_proj"])
def test_other_set_ups_checkpoint_the_whole_core(device, case):
    """Where the heads cannot be grouped (eager attention returns weights, dropout draws random numbers, a
    projection is not a plain Linear or has hooks), the core is checkpointed whole and matches the native module."""
    config = tiny_attention_config(12, "eager" if case == "eager" else "sdpa")
    native, liger = attention_pair(config, device, LigerDeepseekV3RecomputeAttention)
    if case == "dropout":
        liger.attention_dropout = 0.5  # random masks differ between the passes: only the rule is checked
        assert not liger._liger_head_groups_apply()
        liger.eval()
        assert liger._liger_head_groups_apply()  # no dropout outside training
        return
    if case == "wrapped_o_proj":
        native.o_proj, liger.o_proj = _wrapped_linear(native.o_proj), _wrapped_linear(liger.o_proj)
    hook_calls = []
    if case == "hooked_o_proj":  # the hook must still see o_proj's input and output
        liger.o_proj.register_forward_hook(lambda module, args, out: hook_calls.append(out.shape))
    assert not liger._liger_head_groups_apply()
    hidden, cos, sin, mask = _inputs(config, device, 2, 7)
    out = run_attention(liger, hidden, cos, sin, mask)
    assert type(out.grad_fn).__name__ != "LigerHeadGroupedAttentionFunctionBackward"
    assert len(hook_calls) == (case == "hooked_o_proj")
    ref = run_attention(native, hidden, cos, sin, mask)
    torch.testing.assert_close(out, ref, **FP32)
    assert_attention_grads_match(out, ref, hidden, liger, native, FP32)


@pytest.mark.cuda
@pytest.mark.parametrize("liger_class", [LigerDeepseekV3RecomputeAttention, LigerDeepseekV3Attention])
@pytest.mark.parametrize("precision", ["autocast", "bf16"])
def test_head_grouped_on_cuda_matches_all_heads_at_once(monkeypatch, liger_class, precision):
    """bf16 weights, or fp32 weights under bf16 autocast (mixed-precision training, where a recompute must cast as
    the forward did): one head per group against the plain class running every head at once; the gradients come
    back in the weights' dtype."""
    config = tiny_attention_config(12, "sdpa")
    batch, seq_len = 2, 33
    budget = _group_bytes_for(1, config, batch * seq_len, 2)
    monkeypatch.setattr(head_groups, "RECOMPUTE_GROUP_BYTES", budget)
    monkeypatch.setattr(head_groups, "KEPT_GROUP_BYTES", budget)
    plain, liger = attention_pair(config, "cuda", liger_class)
    plain.__class__ = LigerDeepseekV3Attention
    monkeypatch.setattr(plain, "_liger_head_groups_apply", lambda: False)  # every head at once
    hidden, cos, sin, mask = _inputs(config, "cuda", batch, seq_len)
    if precision == "bf16":
        plain.to(torch.bfloat16)
        liger.to(torch.bfloat16)
        hidden = hidden.detach().to(torch.bfloat16).requires_grad_()
    results = []
    for module in (liger, plain):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "autocast"):
            out = run_attention(module, hidden, cos, sin, mask)
        grad = torch.ones_like(out)
        results.append((out, vjp_grads([out], [hidden, *module.parameters()], [grad])))
    (out, got), (ref, want) = results
    assert type(out.grad_fn).__name__ == "LigerHeadGroupedAttentionFunctionBackward"
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        scale = w.float().abs().max().item()
        assert (g.float() - w.float()).abs().max().item() <= 2e-2 * scale + 1e-3


@pytest.mark.slow  # whole models under checkpointing, four times: a minute and more on the interpreter
@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("liger_class", [LigerDeepseekV3RecomputeAttention, LigerDeepseekV3Attention])
def test_whole_model_with_gradient_checkpointing(device, monkeypatch, liger_class, use_reentrant):
    """Head groups inside transformers' gradient checkpointing of the decoder layers: the loss and every gradient
    match the native model's, and the head-grouped path did run."""
    monkeypatch.setattr(head_groups, "RECOMPUTE_GROUP_BYTES", 1)  # one head a group
    monkeypatch.setattr(head_groups, "KEPT_GROUP_BYTES", 1)
    grouped_runs = []
    original = liger_class._liger_head_grouped
    monkeypatch.setattr(
        liger_class, "_liger_head_grouped", lambda self, *a: grouped_runs.append(1) or original(self, *a)
    )
    native, liger, config = model_pair(device, liger_class)
    input_ids = torch.randint(0, config.vocab_size, (2, 8), device=device)
    losses = []
    for model in (native, liger):
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
        losses.append(model(input_ids=input_ids, labels=input_ids).loss)
        losses[-1].backward()
    assert grouped_runs
    torch.testing.assert_close(losses[1], losses[0], **FP32)
    for (name, p), q in zip(native.named_parameters(), liger.parameters()):
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, **GROUPED, msg=lambda m, name=name: f"{name}: {m}")
