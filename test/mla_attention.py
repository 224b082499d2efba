"""DeepSeek-V3 attention (MLA) helpers shared by the RoPE kernel and attention tests: position layouts, cos/sin,
the native / Liger attention pair, and the gradient comparison."""

import copy

import torch
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

from liger_dspine.models.deepseek_v3.attention import NATIVE_CACHE_ARG
from liger_dspine.models.deepseek_v3.attention import LigerDeepseekV3Attention
from tiny_models import tiny_attention_config
from tiny_models import tiny_rope_config

# fp32: both sides do the same fp32 operations; a GPU may fuse a product and a sum (1 ulp), and the rope-key
# gradient sums heads in another order.
FP32 = dict(atol=1e-6, rtol=1e-5)


def layout_position_ids(layout: str, batch: int, seq_len: int) -> torch.Tensor:
    if layout == "contiguous":  # one row of positions shared by the batch: cos/sin are [1, S, R]
        return torch.arange(seq_len)[None]
    if layout == "offset":  # a different start per row, as after a cache
        return torch.arange(seq_len)[None] + torch.tensor([[3], [11]])[:batch]
    if layout == "packed":  # several documents per row
        first = torch.cat([torch.arange(3), torch.arange(seq_len - 3)])
        second = torch.cat([torch.arange(2), torch.arange(2), torch.arange(seq_len - 4)])
        return torch.stack([first, second])[:batch]
    raise ValueError(layout)


def cos_sin(rope_dim: int, position_ids: torch.Tensor, device, dtype=torch.float32, yarn: bool = False):
    rotary = DeepseekV3RotaryEmbedding(tiny_rope_config(rope_dim, yarn)).to(device)
    x = torch.empty(1, dtype=dtype, device=device)
    return rotary(x, position_ids.to(device))


def vjp_grads(outputs, inputs, grad_outputs):
    loss = sum((o * g).sum() for o, g in zip(outputs, grad_outputs))
    return torch.autograd.grad(loss, inputs)


def causal_mask(batch, q_len, kv_len, device):
    offset = kv_len - q_len
    allowed = torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(offset)
    mask = torch.zeros(q_len, kv_len, device=device).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return mask[None, None].expand(batch, 1, q_len, kv_len)


def attention_pair(config, device, liger_class=LigerDeepseekV3Attention):
    torch.manual_seed(0)
    native = DeepseekV3Attention(config, layer_idx=0).to(device)
    for p in native.parameters():  # RMSNorm weights start at ones: make them count
        torch.nn.init.normal_(p, mean=1.0 if p.dim() == 1 else 0.0, std=0.2)
    liger = copy.deepcopy(native)
    liger.__class__ = liger_class  # as an instance patch does
    return native, liger


def run_attention(module, hidden, cos, sin, mask, cache=None, cache_arg=NATIVE_CACHE_ARG):
    out, _ = module(hidden, position_embeddings=(cos, sin), attention_mask=mask, **{cache_arg: cache})
    return out


def assert_attention_grads_match(out, ref, hidden, liger, native, tolerance):
    """Backward of one random output gradient through both modules: the hidden states' and every parameter's
    gradients agree within ``tolerance``, each named on failure."""
    grad = torch.randn_like(ref)
    got = vjp_grads([out], [hidden, *liger.parameters()], [grad])
    want = vjp_grads([ref], [hidden, *native.parameters()], [grad])
    names = ["hidden_states"] + [name for name, _ in native.named_parameters()]
    for name, g, w in zip(names, got, want):
        torch.testing.assert_close(g, w, **tolerance, msg=lambda m, name=name: f"{name}: {m}")


def model_pair(device, liger_class):
    """(native, copy) two-layer causal LMs (sdpa), the copy's attention modules turned into ``liger_class``; and the
    config."""
    config = tiny_attention_config(q_lora_rank=12, attn_implementation="sdpa")
    torch.manual_seed(0)
    native = DeepseekV3ForCausalLM(config).to(device)
    liger = copy.deepcopy(native)
    for layer in liger.model.layers:
        layer.self_attn.__class__ = liger_class
    return native, liger, config
