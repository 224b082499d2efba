"""The fused indexer scores (ops/indexer_scores.py) against fp64 torch: fp32, fp16 and mixed fp16 / fp32 on a CPU
through Triton's interpreter, bf16 on CUDA at DeepSeek-V3.2's indexer widths; and DeepSeek-V3.2's, GLM-5's and V4's
indexer modules against transformers' on the tiny models (same scores, same top-k)."""

import copy
import sys
from pathlib import Path

import pytest
import torch

from liger_dspine.ops.indexer_scores import liger_indexer_scores

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tiny_family import CASES  # noqa: E402


def reference(q, k, weights, scale):
    dots = torch.einsum("bshd,btd->bsht", q.double(), k.double())
    return (torch.relu(dots) * weights.double()[..., None]).sum(2) * scale


@pytest.mark.parametrize(
    "shape, q_dtype, k_dtype",
    [
        ((2, 70, 5, 32, 90), torch.float32, torch.float32),  # ragged tiles both ways
        ((1, 64, 4, 16, 64), torch.float16, torch.float16),
        ((1, 20, 3, 64, 33), torch.float16, torch.float32),  # fp32 compressed keys (V4)
    ],
)
def test_matches_fp64_reference(shape, q_dtype, k_dtype, device):
    batch, seq, heads, dim, keys = shape
    generator = torch.Generator().manual_seed(seq + keys)
    q = torch.randn(batch, seq, heads, dim, generator=generator).to(device, q_dtype)
    k = torch.randn(batch, keys, dim, generator=generator).to(device, k_dtype)
    weights = torch.randn(batch, seq, heads, generator=generator).to(device)
    got = liger_indexer_scores(q, k, weights, dim**-0.5)
    assert got.dtype == torch.float32 and got.shape == (batch, seq, keys)
    torch.testing.assert_close(got.double(), reference(q, k, weights, dim**-0.5), atol=1e-5, rtol=1e-5)


def test_strided_queries_and_bad_shapes(device):
    q = torch.randn(1, 8, 2, 2, 16, device=device)[:, :, :, 0]  # heads and rows strided, channels contiguous
    k, weights = torch.randn(1, 12, 16, device=device), torch.rand(1, 8, 2, device=device)
    got = liger_indexer_scores(q, k, weights, 1.0)
    torch.testing.assert_close(got.double(), reference(q, k, weights, 1.0), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"expect q \[B, S, H, D\] and k \[B, T, D\]"):
        liger_indexer_scores(q, k[..., :8], weights, 1.0)
    with pytest.raises(ValueError, match="expect weights"):
        liger_indexer_scores(q, k, weights[..., :1], 1.0)
    with pytest.raises(ValueError, match="head dim that is a power of two >= 16"):
        liger_indexer_scores(q[..., :12], k[..., :12], weights, 1.0)


def _native_and_patched(model_type, device, **overrides):
    case = CASES[model_type]
    native = case.build(**overrides).to(device)  # skips where this transformers lacks the model
    patched = copy.deepcopy(native)
    case.apply_fn()(model=patched)
    return case, native, patched


def _capture(module_type, model, input_ids, what):
    """What each ``module_type`` module of model returned in one forward."""
    seen = []
    hooks = [
        m.register_forward_hook(lambda _m, _args, out: seen.append(out.detach().clone()))
        for m in model.modules()
        if type(m).__name__ == module_type
    ]
    with torch.no_grad():
        model(input_ids=input_ids)
    for hook in hooks:
        hook.remove()
    assert seen, f"no {what} ran"
    return seen


@pytest.mark.parametrize("model_type, prefix", [("deepseek_v32", "DeepseekV32"), ("glm_moe_dsa", "GlmMoeDsa")])
def test_dsa_indexer_selects_as_native(model_type, prefix, device):
    """DeepSeek-V3.2's half-split RoPE and GLM-5's interleaved one; the scores' order decides the top-k."""
    case, native, patched = _native_and_patched(model_type, device)
    input_ids = torch.randint(0, case.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0)).to(device)
    mine = _capture(f"Liger{prefix}Indexer", patched, input_ids, "Liger indexer")
    theirs = _capture(f"{prefix}Indexer", native, input_ids, "native indexer")
    assert len(mine) == len(theirs)
    for got, want in zip(mine, theirs):
        assert got.dtype == want.dtype == torch.int32 and got.shape == want.shape
        assert torch.equal(got.sort(-1).values, want.sort(-1).values)


def test_deepseek_v4_scorer_scores_as_native(device):
    case, native, patched = _native_and_patched("deepseek_v4", device, index_head_dim=16)  # the tiny case's 8 is
    # below the kernel's smallest head dim
    input_ids = torch.randint(0, case.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0)).to(device)
    mine = _capture("LigerDeepseekV4IndexerScorer", patched, input_ids, "Liger scorer")
    theirs = _capture("DeepseekV4IndexerScorer", native, input_ids, "native scorer")
    assert len(mine) == len(theirs) and mine[0].shape[-1] > 0
    for got, want in zip(mine, theirs):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
def test_cuda_bf16_at_v32_widths():
    """64 heads of 128 channels, 1024 queries and keys: bf16 products are exact in fp32, so only the summation
    order differs from an fp64 sum of the same values."""
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(1, 1024, 64, 128, generator=generator).to("cuda", torch.bfloat16)
    k = torch.randn(1, 1024, 128, generator=generator).to("cuda", torch.bfloat16)
    weights = torch.randn(1, 1024, 64, generator=generator).to("cuda") / 8
    got = liger_indexer_scores(q, k, weights, 128**-0.5)
    torch.testing.assert_close(got.double(), reference(q, k, weights, 128**-0.5), atol=1e-4, rtol=1e-5)
