"""ops/embedding.py: the embedding whose weight gradient is one opaque op gives torch's eager numbers."""

import pytest
import torch
import torch.nn.functional as F

from liger_dspine.ops.embedding import liger_embedding


@pytest.mark.parametrize(
    "padding_idx, scale_grad_by_freq, dtype",
    [(None, False, torch.float32), (2, False, torch.float32), (-1, True, torch.float32), (None, False, torch.float16)],
)
def test_embedding_and_its_weight_gradient_equal_torchs(padding_idx, scale_grad_by_freq, dtype):
    torch.manual_seed(0)
    ids = torch.randint(0, 9, (3, 11))
    ids[0, :4] = 2  # repeated ids (and the padding row, where it is one)
    ids[1, -1] = 8
    weight = torch.randn(9, 24, dtype=dtype)
    grad = torch.randn(3, 11, 24, dtype=dtype)

    def run(embed):
        w = weight.clone().requires_grad_(True)
        out = embed(ids, w)
        out.backward(grad)
        return out, w.grad

    out, grad_weight = run(lambda i, w: liger_embedding(i, w, padding_idx, scale_grad_by_freq))
    ref, ref_grad = run(lambda i, w: F.embedding(i, w, padding_idx, scale_grad_by_freq=scale_grad_by_freq))

    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    torch.testing.assert_close(grad_weight, ref_grad, atol=0, rtol=0)
    if padding_idx is not None:
        assert grad_weight[padding_idx].abs().sum() == 0


def test_embedding_refuses_float_ids_and_a_table_that_is_not_2d():
    with pytest.raises(TypeError, match=r"^liger-dspine: embedding ids must be int32 or int64, got torch.float32$"):
        liger_embedding(torch.zeros(2, 3), torch.randn(4, 5))
    with pytest.raises(ValueError, match=r"^liger-dspine: an embedding table must be \[V, D\], got \(4, 5, 6\)$"):
        liger_embedding(torch.zeros(2, 3, dtype=torch.long), torch.randn(4, 5, 6))


@pytest.mark.cuda
def test_embedding_on_cuda_bf16_equals_torchs():
    """bf16 on the GPU: the same CUDA kernels as nn.Embedding (the weight gradient summed per id in fp32)."""
    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (2, 4096), device="cuda")
    weight = torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(2, 4096, 256, device="cuda", dtype=torch.bfloat16)
    results = []
    for embed in (liger_embedding, F.embedding):
        w = weight.clone().requires_grad_(True)
        out = embed(ids, w)
        out.backward(grad)
        results.append((out, w.grad))
    (out, grad_weight), (ref, ref_grad) = results
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    # the per-id sums run in fp32 and are rounded once to bf16 in both; their order may differ between launches
    torch.testing.assert_close(grad_weight.float(), ref_grad.float(), atol=0, rtol=2**-7)
