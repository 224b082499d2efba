"""Fused frozen-head terms (ops/frozen_head_objective.py) against the eager ``frozen_head_terms``.

Eager rejects ignored labels (-100), so its reference for them is computed with the label replaced by 0 and then
ce masked to 0 (zero CE gradient) and correct set to False, which is the fused contract.

CPU (interpreter, fp32): Gaussian inputs, tiny shapes, no near ties, so candidate ids must match exactly; the only
difference left is fp32 rounding (chunked GEMMs, another summation order), a few fp32 ulps of values O(10).

CUDA: the inputs are small integers times powers of two, so every logit is an exact multiple of 1/32 whatever the
GEMM's order or chunking (bf16 reductions pinned to fp32), and fused and eager see bitwise equal logits. The
comparison then measures only the kernel's fp32 math, whatever the dtype; those logits tie a lot, so candidates
are compared through their logits and teacher probabilities, not by index.
"""

import pytest
import torch

from liger_dspine.models.dspine.frozen_head_terms import frozen_head_terms
from liger_dspine.ops.frozen_head_objective import IGNORE_INDEX
from liger_dspine.ops.frozen_head_objective import default_chunk_rows
from liger_dspine.ops.frozen_head_objective import liger_frozen_head_terms

ROWS, HIDDEN, VOCAB, TOP_K = 6, 16, 40, 4
MASS_THRESHOLD = 1e-4  # DSpine's default candidate_mass_threshold


def gaussian_inputs(device, rows=ROWS, hidden=HIDDEN, vocab=VOCAB, seed=0):
    """Draft, head, labels, teacher in fp32; logits have a standard deviation of about 3."""
    generator = torch.Generator().manual_seed(seed)
    draft = torch.randn(rows, hidden, generator=generator)
    head = torch.randn(vocab, hidden, generator=generator) * (3.0 / hidden**0.5)
    labels = torch.randint(0, vocab, (rows,), generator=generator)
    teacher = draft + torch.randn(rows, hidden, generator=generator)
    return tuple(t.to(device) for t in (draft, head, labels, teacher))


def exact_inputs(device, dtype, rows, hidden, vocab, seed=0):
    """Entries in {-2..2}/4 (rows) and {-2..2}/8 (head): exact in bf16, logits exact multiples of 1/32 (std 2)."""
    generator = torch.Generator().manual_seed(seed)
    draft = torch.randint(-2, 3, (rows, hidden), generator=generator) / 4
    teacher = torch.randint(-2, 3, (rows, hidden), generator=generator) / 4
    head = torch.randint(-2, 3, (vocab, hidden), generator=generator) / 8
    labels = torch.randint(0, vocab, (rows,), generator=generator)
    draft, teacher, head = (t.to(device=device, dtype=dtype) for t in (draft, teacher, head))
    return draft, head, labels.to(device), teacher


def eager_terms(draft, head, labels, teacher=None, top_k=0):
    """The eager function, with ignored labels as the fused contract defines them."""
    ignored = labels == IGNORE_INDEX
    terms = frozen_head_terms(draft, head, labels.masked_fill(ignored, 0), teacher, top_k)
    return terms._replace(ce=terms.ce.masked_fill(ignored, 0.0), correct=terms.correct & ~ignored)


def terms_and_grad(fn, draft, head, labels, teacher=None, top_k=0, grad_ce=None, grad_l1=None, **kwargs):
    """Run ``fn`` on a fresh leaf copy of ``draft``; backpropagate sum(ce * grad_ce) + sum(l1 * grad_l1)."""
    leaf = draft.detach().clone().requires_grad_(True)
    terms = fn(leaf, head, labels, teacher, top_k, **kwargs)
    loss = (terms.ce * grad_ce).sum()
    if grad_l1 is not None:
        loss = loss + (terms.l1 * grad_l1).sum()
    loss.backward()
    return terms, leaf.grad


def upstream_grads(rows, device, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(rows, generator=generator).to(device), torch.rand(rows, generator=generator).to(device)


def assert_max_error(actual, expected, bound):
    """max |actual - expected| <= bound * max |expected| (errors relative to the tensor's scale)."""
    actual, expected = actual.double(), expected.double()
    error = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert error <= bound * scale, f"max error {error:.3e} > {bound:.1e} x max |expected| {scale:.3e}"


# ------------------------------------------------------------------------------------------------ CPU and CUDA
@pytest.mark.parametrize("chunk_rows", [None, 1, 4])
def test_matches_eager_forward_and_backward(device, chunk_rows):
    draft, head, labels, teacher = gaussian_inputs(device)
    labels[1] = labels[4] = IGNORE_INDEX
    grad_ce, grad_l1 = upstream_grads(ROWS, device)
    fused, fused_grad = terms_and_grad(
        liger_frozen_head_terms, draft, head, labels, teacher, TOP_K, grad_ce, grad_l1, chunk_rows=chunk_rows
    )
    eager, eager_grad = terms_and_grad(eager_terms, draft, head, labels, teacher, TOP_K, grad_ce, grad_l1)

    # fp32 values O(10) summed over V=40 in another order: a few ulps (1e-6 relative), far inside 1e-5.
    torch.testing.assert_close(fused.ce, eager.ce, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused.l1, eager.l1, atol=1e-5, rtol=1e-5)
    assert fused.ce[1].item() == 0.0 and fused.ce[4].item() == 0.0
    assert torch.equal(fused.correct, eager.correct)
    assert not fused.correct[1] and not fused.correct[4]
    assert torch.equal(fused.candidate_ids, eager.candidate_ids)  # no near ties in these logits
    # Teacher probabilities exp(y - lse) vs softmax: fp32 relative error ~|y - lse| x 2^-24 << 1e-5.
    torch.testing.assert_close(fused.candidate_teacher_probs, eager.candidate_teacher_probs, atol=0, rtol=1e-5)
    # Gradients: the same fp32 dz up to ulps, then one [C, V] x [V, H] GEMM: 1e-5 absolute, 1e-4 relative.
    torch.testing.assert_close(fused_grad, eager_grad, atol=1e-5, rtol=1e-4)
    assert fused.ce.dtype == fused.l1.dtype == fused.candidate_teacher_probs.dtype == torch.float32
    assert fused.correct.dtype == torch.bool and fused.candidate_ids.dtype == torch.int64


def test_low_candidate_mass_rows(device):
    """Rows whose teacher mass on the draft's candidates is far below the refinement threshold."""
    draft, head, labels, teacher = gaussian_inputs(device)
    teacher[::2] = -1.5 * draft[::2]  # the teacher prefers the draft's least likely tokens
    fused = liger_frozen_head_terms(draft, head, labels, teacher, TOP_K)
    eager = eager_terms(draft, head, labels, teacher, TOP_K)
    eager_mass = eager.candidate_teacher_probs.sum(-1)
    assert (eager_mass[::2] < 1e-2 * MASS_THRESHOLD).all() and (eager_mass[1::2] > 1e2 * MASS_THRESHOLD).all()
    assert torch.equal(fused.candidate_ids, eager.candidate_ids)
    # Probabilities down to ~1e-12: still relative fp32 error ~|y - lse| x 2^-24 (|y - lse| < 60 here) << 1e-5.
    torch.testing.assert_close(fused.candidate_teacher_probs, eager.candidate_teacher_probs, atol=0, rtol=1e-5)
    fused_mass = fused.candidate_teacher_probs.sum(-1)
    assert torch.equal(fused_mass > MASS_THRESHOLD, eager_mass > MASS_THRESHOLD)
    torch.testing.assert_close(fused.l1, eager.l1, atol=1e-5, rtol=1e-5)  # fp32, as above


def test_ce_only_path(device):
    draft, head, labels, _ = gaussian_inputs(device)
    labels[2] = IGNORE_INDEX
    grad_ce, _ = upstream_grads(ROWS, device)
    fused, fused_grad = terms_and_grad(liger_frozen_head_terms, draft, head, labels, None, 0, grad_ce)
    eager, eager_grad = terms_and_grad(eager_terms, draft, head, labels, None, 0, grad_ce)
    assert fused.l1 is None and fused.candidate_ids is None and fused.candidate_teacher_probs is None
    torch.testing.assert_close(fused.ce, eager.ce, atol=1e-5, rtol=1e-5)  # fp32, as in the full test
    assert torch.equal(fused.correct, eager.correct)
    torch.testing.assert_close(fused_grad, eager_grad, atol=1e-5, rtol=1e-4)  # fp32, as in the full test
    assert fused_grad[2].abs().max().item() == 0.0  # an ignored row gets no CE gradient


def test_one_term_used(device):
    """Only ce (l1 unused) or only l1 reaches the loss: the other upstream gradient is zero."""
    draft, head, labels, teacher = gaussian_inputs(device)
    grad_ce, grad_l1 = upstream_grads(ROWS, device)
    zeros = torch.zeros_like(grad_ce)
    _, fused_grad = terms_and_grad(liger_frozen_head_terms, draft, head, labels, teacher, TOP_K, grad_ce)
    _, eager_grad = terms_and_grad(eager_terms, draft, head, labels, teacher, TOP_K, grad_ce)
    torch.testing.assert_close(fused_grad, eager_grad, atol=1e-5, rtol=1e-4)  # fp32, as in the full test
    _, fused_grad = terms_and_grad(liger_frozen_head_terms, draft, head, labels, teacher, TOP_K, zeros, grad_l1)
    _, eager_grad = terms_and_grad(eager_terms, draft, head, labels, teacher, TOP_K, zeros, grad_l1)
    torch.testing.assert_close(fused_grad, eager_grad, atol=1e-5, rtol=1e-4)


def test_teacher_equal_to_draft_gives_no_l1(device):
    """sign(p - q) = 0 where p == q: a teacher row equal to its draft row has l1 = 0 and no L1 gradient."""
    draft, head, labels, teacher = gaussian_inputs(device)
    teacher[3] = draft[3]
    _, grad_l1 = upstream_grads(ROWS, device)
    fused, fused_grad = terms_and_grad(
        liger_frozen_head_terms, draft, head, labels, teacher, TOP_K, torch.zeros_like(grad_l1), grad_l1
    )
    assert fused.l1[3].item() == 0.0
    assert fused_grad[3].abs().max().item() == 0.0
    assert fused_grad[2].abs().max().item() > 0.0


def test_chunking_invariance(device):
    draft, head, labels, teacher = gaussian_inputs(device, rows=13)
    labels[5] = IGNORE_INDEX
    grad_ce, grad_l1 = upstream_grads(13, device)
    results = [
        terms_and_grad(liger_frozen_head_terms, draft, head, labels, teacher, TOP_K, grad_ce, grad_l1, chunk_rows=chunk)
        for chunk in (1, 3, 8, 13, 64)
    ]
    first, first_grad = results[0]
    for terms, grad in results[1:]:
        # Rows are independent: only the GEMM's fp32 rounding may depend on the chunk (ulps of O(10) values).
        torch.testing.assert_close(terms.ce, first.ce, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(terms.l1, first.l1, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(terms.candidate_teacher_probs, first.candidate_teacher_probs, atol=0, rtol=1e-5)
        torch.testing.assert_close(grad, first_grad, atol=1e-5, rtol=1e-4)
        assert torch.equal(terms.candidate_ids, first.candidate_ids)
        assert torch.equal(terms.correct, first.correct)


def test_gradient_reaches_only_the_draft(device):
    draft, head, labels, teacher = gaussian_inputs(device)
    draft.requires_grad_(True)
    teacher.requires_grad_(True)
    terms = liger_frozen_head_terms(draft, head, labels, teacher, TOP_K)
    (terms.ce.sum() + terms.l1.sum()).backward()
    assert draft.grad is not None and teacher.grad is None and head.grad is None
    assert not terms.correct.requires_grad and not terms.candidate_teacher_probs.requires_grad
    with pytest.raises(ValueError, match="no gradient"):
        liger_frozen_head_terms(draft, head.clone().requires_grad_(True), labels, teacher, TOP_K)
    with torch.no_grad():  # a head that requires grad is fine when nothing is differentiated
        terms = liger_frozen_head_terms(draft, head.clone().requires_grad_(True), labels, teacher, TOP_K)
    assert terms.ce.grad_fn is None and terms.l1.grad_fn is None


def test_saves_nothing_of_vocabulary_size(device):
    draft, head, labels, teacher = gaussian_inputs(device)
    draft.requires_grad_(True)
    saved = []

    def pack(tensor):
        saved.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        liger_frozen_head_terms(draft, head, labels, teacher, TOP_K)
    assert saved and set(saved) <= {(ROWS, HIDDEN), (VOCAB, HIDDEN), (ROWS,)}, saved


def test_empty_rows_and_bad_arguments(device):
    draft, head, labels, teacher = gaussian_inputs(device)
    empty = draft[:0].clone().requires_grad_(True)
    terms = liger_frozen_head_terms(empty, head, labels[:0], teacher[:0], TOP_K)
    assert terms.ce.shape == (0,) and terms.candidate_ids.shape == (0, TOP_K)
    (terms.ce.sum() + terms.l1.sum()).backward()
    assert empty.grad.shape == (0, HIDDEN)
    with pytest.raises(ValueError, match="top_k >= 1"):
        liger_frozen_head_terms(draft, head, labels, teacher, 0)
    with pytest.raises(ValueError, match="must match"):
        liger_frozen_head_terms(draft.double(), head, labels, teacher, TOP_K)
    for bad in (VOCAB, -1, -101):  # checked on the host, before any kernel: the message names label and vocabulary
        bad_labels = labels.clone()
        bad_labels[3] = bad
        with pytest.raises(ValueError, match=f"label {bad} is outside the vocabulary \\[0, {VOCAB}\\)"):
            liger_frozen_head_terms(draft, head, bad_labels, teacher, TOP_K)
    with pytest.raises(ValueError, match="integer labels"):
        liger_frozen_head_terms(draft, head, labels.float(), teacher, TOP_K)


def test_default_chunk_rows():
    assert default_chunk_rows(4096, 1024, 32000) == 128  # chunk x V ~ R x H
    assert default_chunk_rows(16384, 4096, 32000) == 2048  # liger-kernel's worked example
    assert default_chunk_rows(6, 16, 40) == 2
    assert default_chunk_rows(5, 64, 40) == 5  # never more than R
    assert default_chunk_rows(0, 16, 40) == 1


# ---------------------------------------------------------------------------------------------------- CUDA only
CUDA_ROWS, CUDA_HIDDEN, CUDA_VOCAB, CUDA_TOP_K = 4096, 1024, 32000, 16


@pytest.fixture
def exact_bf16_gemms(monkeypatch):
    """bf16/fp16 GEMMs reduce in fp32, so the exact-input logits do not depend on the GEMM's split."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_fp16_reduced_precision_reduction", False)


def eager_logits(draft, head):
    return torch.nn.functional.linear(draft, head).float()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_large_matches_eager(exact_bf16_gemms, dtype):
    draft, head, labels, teacher = exact_inputs("cuda", dtype, CUDA_ROWS, CUDA_HIDDEN, CUDA_VOCAB)
    labels[::97] = IGNORE_INDEX
    teacher[::5] = -draft[::5]  # rows of negligible teacher mass on the candidates
    grad_ce, grad_l1 = upstream_grads(CUDA_ROWS, "cuda")
    fused, fused_grad = terms_and_grad(
        liger_frozen_head_terms, draft, head, labels, teacher, CUDA_TOP_K, grad_ce, grad_l1
    )
    eager, eager_grad = terms_and_grad(eager_terms, draft, head, labels, teacher, CUDA_TOP_K, grad_ce, grad_l1)

    # Equal logits: only fp32 summation order over V=32000 differs (~1e-6 relative of O(10) values).
    torch.testing.assert_close(fused.ce, eager.ce, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(fused.l1, eager.l1, atol=1e-4, rtol=1e-5)
    assert torch.equal(fused.correct, eager.correct)  # first maximal index in both
    # Candidates: the same logits in the same descending order (tied ids may be ordered differently).
    logits = eager_logits(draft, head)
    assert torch.equal(logits.gather(-1, fused.candidate_ids), logits.gather(-1, eager.candidate_ids))
    teacher_probs = torch.softmax(eager_logits(teacher, head), dim=-1)
    # fp32 exp(y - lse) vs softmax: relative error ~|y - lse| x 2^-24 plus the lse's ~1e-6.
    torch.testing.assert_close(
        fused.candidate_teacher_probs, teacher_probs.gather(-1, fused.candidate_ids), atol=0, rtol=1e-4
    )
    mass = fused.candidate_teacher_probs.sum(-1)
    # A tie at the K-th place may pick another of the tied ids (another teacher probability): compare the candidate
    # mass where the K-th and (K+1)-th logits differ, which here is most rows.
    top = logits.topk(CUDA_TOP_K + 1, dim=-1).values
    untied = top[:, -2] != top[:, -1]
    assert untied.float().mean() > 0.5
    eager_mass = eager.candidate_teacher_probs.sum(-1)
    assert torch.equal((mass > MASS_THRESHOLD)[untied], (eager_mass > MASS_THRESHOLD)[untied])
    torch.testing.assert_close(mass[untied], eager_mass[untied], atol=0, rtol=1e-4)
    assert (mass[::5] <= MASS_THRESHOLD).float().mean() > 0.9
    # Gradients: dz equal up to fp32 ulps, rounded to the dtype, then a GEMM of another shape (row chunks), for
    # which cuBLAS picks another kernel and summation order over the 32000-long reduction. fp32: measured 1.18e-5
    # against a scale of 0.29 (4.0e-5 of it) on the H200, so 1e-4; bf16: a dz rounding flip moves an output by
    # about one bf16 ulp (2^-8 relative), so 1e-2 of the scale.
    assert_max_error(fused_grad, eager_grad, 1e-4 if dtype == torch.float32 else 1e-2)
    assert fused_grad.dtype == dtype


@pytest.mark.cuda
def test_cuda_chunking_invariance(exact_bf16_gemms):
    draft, head, labels, teacher = exact_inputs("cuda", torch.bfloat16, 1024, CUDA_HIDDEN, CUDA_VOCAB)
    grad_ce, grad_l1 = upstream_grads(1024, "cuda")
    results = [
        terms_and_grad(
            liger_frozen_head_terms, draft, head, labels, teacher, CUDA_TOP_K, grad_ce, grad_l1, chunk_rows=chunk
        )
        for chunk in (None, 37, 256, 1024)
    ]
    first, first_grad = results[0]
    logits = eager_logits(draft, head)
    for terms, grad in results[1:]:
        # Bitwise equal logits per row, and the kernels treat rows alone: identical results.
        torch.testing.assert_close(terms.ce, first.ce, atol=0, rtol=0)
        torch.testing.assert_close(terms.l1, first.l1, atol=0, rtol=0)
        assert torch.equal(terms.correct, first.correct)
        assert torch.equal(logits.gather(-1, terms.candidate_ids), logits.gather(-1, first.candidate_ids))
        # bf16 GEMMs of other shapes may round dx differently: 1e-2 of the scale (one bf16 ulp is 2^-8).
        assert_max_error(grad, first_grad, 1e-2)


@pytest.mark.cuda
def test_cuda_autocast_matches_eager(exact_bf16_gemms):
    draft, head, labels, teacher = exact_inputs("cuda", torch.float32, 512, CUDA_HIDDEN, CUDA_VOCAB)
    grad_ce, grad_l1 = upstream_grads(512, "cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        fused, fused_grad = terms_and_grad(
            liger_frozen_head_terms, draft, head, labels, teacher, CUDA_TOP_K, grad_ce, grad_l1
        )
        eager, eager_grad = terms_and_grad(eager_terms, draft, head, labels, teacher, CUDA_TOP_K, grad_ce, grad_l1)
    torch.testing.assert_close(fused.ce, eager.ce, atol=1e-4, rtol=1e-5)  # equal logits, as above
    torch.testing.assert_close(fused.l1, eager.l1, atol=1e-4, rtol=1e-5)
    assert fused_grad.dtype == torch.float32
    assert_max_error(fused_grad, eager_grad, 1e-2)  # bf16 GEMM of the gradient, as above


@pytest.mark.cuda
def test_cuda_peak_memory_stays_below_one_logits_buffer():
    draft, head, labels, teacher = exact_inputs("cuda", torch.bfloat16, CUDA_ROWS, CUDA_HIDDEN, CUDA_VOCAB)
    draft.requires_grad_(True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    terms = liger_frozen_head_terms(draft, head, labels, teacher, CUDA_TOP_K)
    (terms.ce.sum() + terms.l1.sum()).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - baseline
    # Chunks of 128 rows: two [128, V] bf16 buffers (16 MB) plus [R, H] and per-row outputs. One fp32 [R, V]
    # logits buffer, what eager holds several of, is 524 MB; allow a quarter of it.
    assert extra < CUDA_ROWS * CUDA_VOCAB * 4 / 4, extra
