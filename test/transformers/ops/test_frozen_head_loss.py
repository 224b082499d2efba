"""The fused frozen-head loss (ops/frozen_head_loss.py): sum(a * ce + b * l1) and its input gradient, formed in the
forward, against the eager ``frozen_head_terms``.

CPU (interpreter, fp32): Gaussian logits of std about 3, no near ties, so candidate ids must match exactly, and the
vocabulary (3000) is wide enough for the top-k to go through the sub-block maxima (K x 256 < V). Differences left
are fp32 rounding of values O(10): 1e-5.
"""

import pytest
import torch

from liger_dspine.models.dspine.frozen_head_terms import frozen_head_terms
from liger_dspine.ops.frozen_head_kernels import IGNORE_INDEX
from liger_dspine.ops.frozen_head_kernels import fuses_candidates
from liger_dspine.ops.frozen_head_loss import liger_frozen_head_loss
from liger_dspine.ops.frozen_head_loss import loss_chunk_rows

ROWS, HIDDEN, VOCAB, TOP_K = 13, 16, 3000, 4


def inputs(device, rows=ROWS, vocab=VOCAB, seed=0):
    generator = torch.Generator().manual_seed(seed)
    draft = torch.randn(rows, HIDDEN, generator=generator)
    head = torch.randn(vocab, HIDDEN, generator=generator) * (3.0 / HIDDEN**0.5)
    labels = torch.randint(0, vocab, (rows,), generator=generator)
    teacher = draft + torch.randn(rows, HIDDEN, generator=generator)
    ce_scale, l1_scale = torch.rand(rows, generator=generator), torch.rand(rows, generator=generator)
    return tuple(t.to(device) for t in (draft, head, labels, teacher, ce_scale, l1_scale))


def eager_loss(draft, head, labels, teacher, ce_scale, l1_scale, top_k=TOP_K):
    """The eager terms, with ignored labels as the fused contract defines them (ce = 0, no CE gradient)."""
    leaf = draft.detach().clone().requires_grad_(True)
    ignored = labels == IGNORE_INDEX
    terms = frozen_head_terms(leaf, head, labels.masked_fill(ignored, 0), teacher, top_k if teacher is not None else 0)
    ce = terms.ce.masked_fill(ignored, 0.0)
    loss = (ce * ce_scale).sum()
    if teacher is not None:
        loss = loss + (terms.l1 * l1_scale).sum()
    loss.backward()
    return loss.detach(), terms._replace(ce=ce.detach(), correct=terms.correct & ~ignored), leaf.grad


def fused_loss(draft, head, labels, teacher, ce_scale, l1_scale, top_k=TOP_K, **kwargs):
    leaf = draft.detach().clone().requires_grad_(True)
    out = liger_frozen_head_loss(leaf, head, labels, ce_scale, teacher, l1_scale, top_k, **kwargs)
    out.loss.backward()
    return out.loss.detach(), out.terms, leaf.grad


@pytest.mark.parametrize(
    "chunk_rows, vocab, top_k",
    [
        (None, VOCAB, TOP_K),
        (1, VOCAB, TOP_K),
        (5, VOCAB, TOP_K),  # the stats kernel makes the candidates and dz (K x 256 < V)
        (5, 1000, TOP_K),  # torch's top-k over the whole row, then the gradient kernel (K x 256 >= V)
        (None, VOCAB, 65),  # torch's top-k over the sub-blocks (K above the kernel's 64)
    ],
)
def test_matches_eager_terms_and_gradient(device, chunk_rows, vocab, top_k):
    assert fuses_candidates(TOP_K, VOCAB) and not fuses_candidates(TOP_K, 1000) and not fuses_candidates(65, VOCAB)
    draft, head, labels, teacher, ce_scale, l1_scale = inputs(device, vocab=vocab)
    labels[2] = IGNORE_INDEX
    loss, terms, grad = fused_loss(draft, head, labels, teacher, ce_scale, l1_scale, top_k, chunk_rows=chunk_rows)
    ref_loss, ref_terms, ref_grad = eager_loss(draft, head, labels, teacher, ce_scale, l1_scale, top_k)
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(terms.ce, ref_terms.ce, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(terms.l1, ref_terms.l1, atol=1e-5, rtol=1e-5)
    assert torch.equal(terms.correct, ref_terms.correct)
    assert torch.equal(terms.candidate_ids, ref_terms.candidate_ids)
    torch.testing.assert_close(terms.candidate_teacher_probs, ref_terms.candidate_teacher_probs, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad, ref_grad, atol=1e-5, rtol=1e-5)
    assert not any(t.requires_grad for t in terms if t is not None)


def test_ce_only_matches_eager(device):
    draft, head, labels, _, ce_scale, _ = inputs(device)
    loss, terms, grad = fused_loss(draft, head, labels, None, ce_scale, None, 0)
    ref_loss, ref_terms, ref_grad = eager_loss(draft, head, labels, None, ce_scale, None)
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(terms.ce, ref_terms.ce, atol=1e-5, rtol=1e-5)
    assert terms.l1 is None and terms.candidate_ids is None
    torch.testing.assert_close(grad, ref_grad, atol=1e-5, rtol=1e-5)


def test_a_retained_graph_gives_the_same_gradient_every_time(device):
    draft, head, labels, teacher, ce_scale, l1_scale = inputs(device)
    leaf = draft.clone().requires_grad_(True)
    out = liger_frozen_head_loss(leaf, head, labels, ce_scale, teacher, l1_scale, TOP_K)
    loss = 3.0 * out.loss
    (first,) = torch.autograd.grad(loss, leaf, retain_graph=True)
    loss.backward(retain_graph=True)
    second = leaf.grad.clone()
    loss.backward()
    assert torch.equal(first, second)
    assert torch.equal(leaf.grad, 2 * second)  # accumulated: the kept gradient did not change
    _, _, ref_grad = eager_loss(draft, head, labels, teacher, ce_scale, l1_scale)
    torch.testing.assert_close(first, 3.0 * ref_grad, atol=3e-5, rtol=1e-5)


def test_without_autograd_no_gradient_is_formed(device, monkeypatch):
    draft, head, labels, teacher, ce_scale, l1_scale = inputs(device)
    import liger_dspine.ops.frozen_head_loss as loss_module

    def forbidden(*args, **kwargs):
        raise AssertionError("a gradient was formed without autograd")

    monkeypatch.setattr(loss_module, "write_logit_grads", forbidden)
    monkeypatch.setattr(loss_module, "_project_grads", forbidden)
    with torch.no_grad():
        out = liger_frozen_head_loss(draft.requires_grad_(True), head, labels, ce_scale, teacher, l1_scale, TOP_K)
    assert not out.loss.requires_grad
    out = liger_frozen_head_loss(draft.detach(), head, labels, ce_scale, None, None)  # x needs no gradient
    ref_loss, _, _ = eager_loss(draft, head, labels, None, ce_scale, None)
    torch.testing.assert_close(out.loss, ref_loss, atol=1e-5, rtol=1e-5)


def test_bad_arguments_are_named(device):
    draft, head, labels, teacher, ce_scale, l1_scale = inputs(device)
    with pytest.raises(ValueError, match="l1_scale of shape \\[13\\], got None"):
        liger_frozen_head_loss(draft, head, labels, ce_scale, teacher, None, TOP_K)
    with pytest.raises(ValueError, match="ce_scale of shape \\[13\\], got \\(12,\\)"):
        liger_frozen_head_loss(draft, head, labels, ce_scale[:12])
    bad = labels.clone()
    bad[5] = VOCAB + 7
    with pytest.raises(ValueError, match=f"label {VOCAB + 7} is outside the vocabulary \\[0, {VOCAB}\\)"):
        liger_frozen_head_loss(draft, head, bad, ce_scale, teacher, l1_scale, TOP_K)
    with pytest.raises(ValueError, match="top_k >= 1"):
        liger_frozen_head_loss(draft, head, labels, ce_scale, teacher, l1_scale, 0)
    with pytest.raises(ValueError, match="freeze it"):
        liger_frozen_head_loss(draft, head.clone().requires_grad_(True), labels, ce_scale)
    with pytest.raises(ValueError, match="chunk_rows must be >= 1"):
        liger_frozen_head_loss(draft, head, labels, ce_scale, chunk_rows=0)


def test_chunk_rows_fit_the_budget():
    # [2C, V] bf16 logits within 640 MiB: 1024 rows at Qwen3's 151936-token vocabulary, 1024 at DeepSeek-V3's
    assert loss_chunk_rows(15360, 151936, 2, True, 640 * 2**20) == 1024
    assert loss_chunk_rows(15360, 129280, 2, True, 640 * 2**20) == 1024
    assert loss_chunk_rows(15360, 151936, 2, False, 640 * 2**20) == 2048  # CE only: [C, V]
    assert loss_chunk_rows(300, 151936, 2, True, 640 * 2**20) == 300  # never above R: one chunk
    assert loss_chunk_rows(7, 10**9, 4, True, 1) == 1


def test_chunk_rows_on_a_gpu_fill_the_input_gradient_gemms_last_wave():
    budget = 640 * 2**20
    # H 7168 on 132 SMs: 1152 rows give 252 output tiles of 128 x 256 (1.91 waves), 1024 give 224 (1.70)
    assert loss_chunk_rows(15360, 129280, 2, True, budget, 7168, 132) == 1152
    # H 4096: 1024 rows give 128 tiles (0.97 of a wave), the largest multiple of 128 within the budget (1104 rows)
    assert loss_chunk_rows(15360, 151936, 2, True, budget, 4096, 132) == 1024
    assert loss_chunk_rows(15360, 151936, 2, False, budget, 4096, 132) == 2048
    for rows in (1, 100, 1000):  # never above R
        assert loss_chunk_rows(rows, 129280, 2, True, budget, 7168, 132) == rows
    height = loss_chunk_rows(15360, 129280, 2, True, 2**20, 7168, 132)  # under 128 rows fit: a power of two
    assert height == 2


# ---------------------------------------------------------------------------------------------------- CUDA only
@pytest.mark.cuda
def test_cuda_bf16_matches_eager_and_stays_lean(monkeypatch):
    # Entries in {-2..2}/4 and {-2..2}/8: exact in bf16, logits exact multiples of 1/32 with fp32 GEMM reductions.
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction", False)
    generator = torch.Generator().manual_seed(0)
    rows, hidden, vocab = 4096, 1024, 32000
    draft = (torch.randint(-2, 3, (rows, hidden), generator=generator) / 4).cuda().bfloat16()
    teacher = (torch.randint(-2, 3, (rows, hidden), generator=generator) / 4).cuda().bfloat16()
    head = (torch.randint(-2, 3, (vocab, hidden), generator=generator) / 8).cuda().bfloat16()
    labels = torch.randint(0, vocab, (rows,), generator=generator).cuda()
    ce_scale, l1_scale = (torch.rand(rows, generator=generator).cuda() for _ in range(2))
    ref_loss, ref_terms, ref_grad = eager_loss(draft, head, labels, teacher, ce_scale, l1_scale, 16)

    leaf = draft.clone().requires_grad_(True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = liger_frozen_head_loss(leaf, head, labels, ce_scale, teacher, l1_scale, 16, chunk_rows=512)
    out.loss.backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    # [2 x 512, V] bf16 logits (66 MB) + the fp32 dx (17 MB) + small; eager holds several fp32 [R, V] (524 MB each)
    assert extra < 160 * 2**20, extra
    torch.testing.assert_close(out.loss, ref_loss, atol=1e-2, rtol=1e-5)  # equal logits, fp32 sums over 4096 rows
    torch.testing.assert_close(out.terms.ce, ref_terms.ce, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(out.terms.l1, ref_terms.l1, atol=1e-4, rtol=1e-5)
    logits = torch.nn.functional.linear(draft, head).float()
    assert torch.equal(logits.gather(-1, out.terms.candidate_ids), logits.gather(-1, ref_terms.candidate_ids))
    # dz rounded to bf16 in both; ours projects it in fp32 and rounds once, eager rounds dz @ W to bf16: about one
    # bf16 ulp (2^-8) of the gradient's scale
    error = (leaf.grad.double() - ref_grad.double()).abs().max() / ref_grad.double().abs().max()
    assert error < 1e-2, error


def test_chunk_logits_share_one_buffer():
    """Every chunk's logits are the GEMM's, written into one buffer: no two chunks' logits are alive at once."""
    from liger_dspine.ops.frozen_head_kernels import chunk_logit_passes

    generator = torch.Generator().manual_seed(3)
    draft, teacher = torch.randn(11, 8, generator=generator), torch.randn(11, 8, generator=generator)
    weight = torch.randn(40, 8, generator=generator)
    storages = set()
    for start, end, z, y in chunk_logit_passes(draft, teacher, weight, 4):
        storages.add(z.untyped_storage().data_ptr())
        assert z.shape == y.shape == (end - start, 40)
        torch.testing.assert_close(z, draft[start:end] @ weight.T)
        torch.testing.assert_close(y, teacher[start:end] @ weight.T)
    assert len(storages) == 1
    for start, end, z, y in chunk_logit_passes(draft, None, weight, 4):
        assert y is None
        torch.testing.assert_close(z, draft[start:end] @ weight.T)
