"""The frozen-head stats kernel (ops/frozen_head_kernels.py) on one chunk, against torch on the same logits.

Its passes go over a row in both directions and, where it makes the top-k candidates itself, it also writes dz in
place of z. Checked at several columns per step (one block, several, a partial last one), with and without a
teacher: the normalisers, ce, correct, l1, the sign mass, the candidates, and dz against the formula of the module.
"""

import pytest
import torch

from liger_dspine.ops.frozen_head_kernels import IGNORE_INDEX
from liger_dspine.ops.frozen_head_kernels import chunk_stats
from liger_dspine.ops.frozen_head_kernels import fuses_candidates
from liger_dspine.ops.frozen_head_kernels import write_logit_grads

ROWS, VOCAB, TOP_K = 5, 3000, 4


def logits(device, seed):
    generator = torch.Generator().manual_seed(seed)
    z = torch.randn(ROWS, VOCAB, generator=generator) * 2
    y = z + torch.randn(ROWS, VOCAB, generator=generator)  # a teacher near the draft: signs of both kinds
    labels = torch.randint(0, VOCAB, (ROWS,), generator=generator)
    labels[1] = IGNORE_INDEX
    labels[2] = int(z[2].argmax())  # one correct row
    ce_scale, l1_scale = torch.rand(ROWS, generator=generator), torch.rand(ROWS, generator=generator)
    return [t.to(device) for t in (z, y, labels, ce_scale, l1_scale)]


def reference(z, y, labels, ce_scale, l1_scale, has_teacher):
    """Per-row terms and dz from torch, in fp64."""
    z64 = z.double()
    draft_lse = torch.logsumexp(z64, -1)
    p = torch.exp(z64 - draft_lse[:, None])
    labelled = labels != IGNORE_INDEX
    safe = labels.clamp(min=0)
    ce = torch.where(labelled, draft_lse - z64.gather(-1, safe[:, None])[:, 0], 0.0)
    a = torch.where(labelled, ce_scale.double(), 0.0)
    dz = a[:, None] * (p - torch.nn.functional.one_hot(safe, VOCAB).double())
    out = dict(draft_lse=draft_lse, ce=ce, correct=labelled & (z.argmax(-1) == safe))
    if has_teacher:
        y64 = y.double()
        teacher_lse = torch.logsumexp(y64, -1)
        sign = torch.sign(p - torch.exp(y64 - teacher_lse[:, None]))
        sign_mass = (p * sign).sum(-1)
        dz = dz + l1_scale.double()[:, None] * p * (sign - sign_mass[:, None])
        top = torch.topk(z64, TOP_K, -1)
        out.update(
            teacher_lse=teacher_lse,
            l1=(p - torch.exp(y64 - teacher_lse[:, None])).abs().sum(-1),
            sign_mass=sign_mass,
            ids=top.indices,
            probs=torch.exp(y64.gather(-1, top.indices) - teacher_lse[:, None]),
        )
    return out, dz


@pytest.mark.parametrize("block_v", [256, 1024, 4096])
@pytest.mark.parametrize("has_teacher", [True, False])
@pytest.mark.parametrize("write_grad", [True, False])
def test_stats_candidates_and_gradient_match_torch(device, block_v, has_teacher, write_grad):
    z, y, labels, ce_scale, l1_scale = logits(device, seed=block_v)
    assert fuses_candidates(TOP_K, VOCAB)
    expected, expected_dz = reference(z, y, labels, ce_scale, l1_scale, has_teacher)
    work = z.clone()
    scales = (ce_scale, l1_scale if has_teacher else None) if write_grad else None
    stats = chunk_stats(work, y if has_teacher else None, labels, block_v, top_k=TOP_K, grad_scales=scales)
    close = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats.draft_lse.double(), expected["draft_lse"], **close)
    torch.testing.assert_close(stats.ce.double(), expected["ce"], **close)
    assert torch.equal(stats.correct.bool(), expected["correct"])
    if has_teacher:
        torch.testing.assert_close(stats.teacher_lse.double(), expected["teacher_lse"], **close)
        torch.testing.assert_close(stats.l1.double(), expected["l1"], **close)
        torch.testing.assert_close(stats.sign_mass.double(), expected["sign_mass"], **close)
        assert torch.equal(stats.candidate_ids, expected["ids"])
        torch.testing.assert_close(stats.candidate_probs.double(), expected["probs"], **close)
    else:
        assert stats.candidate_ids is None
    if write_grad:
        torch.testing.assert_close(work.double(), expected_dz, atol=1e-6, rtol=1e-5)
    else:
        assert torch.equal(work, z)


def test_fused_gradient_equals_the_gradient_kernel(device):
    """Written in the stats kernel or by the gradient kernel after it: the same dz, to the bit."""
    z, y, labels, ce_scale, l1_scale = logits(device, seed=7)
    fused = z.clone()
    chunk_stats(fused, y, labels, 1024, top_k=TOP_K, grad_scales=(ce_scale, l1_scale))
    apart = z.clone()
    stats = chunk_stats(apart, y, labels, 1024)
    write_logit_grads(apart, y, labels, ce_scale, l1_scale, stats.draft_lse, stats.teacher_lse, stats.sign_mass, 1024)
    assert torch.equal(fused, apart)


def test_gradient_needs_the_kernels_own_candidates(device):
    z, y, labels, ce_scale, l1_scale = logits(device, seed=3)
    with pytest.raises(ValueError, match="writes dz only after its own top-k"):
        chunk_stats(z, y, labels, top_k=64 + 1, grad_scales=(ce_scale, l1_scale))
