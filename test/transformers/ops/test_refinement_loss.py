"""The refinement loss op (ops/refinement_loss.py) against the objective's eager ``refinement_terms``.

fp32 runs the Triton kernels (through the interpreter on CPU), fp64 the torch path. Rows mix labels among their
candidates and not, teacher masses above and below the threshold, and a duplicated candidate; K = 5 pads to 8 and
the 150 rows span three row blocks with a ragged end.
"""

import pytest
import torch

from liger_dspine.models.dspine.objective import refinement_terms
from liger_dspine.ops.refinement_loss import liger_refinement_loss

CE_WEIGHT, THRESHOLD = 0.3, 0.4


def _inputs(device, dtype, rows=150, top_k=5, hidden=40, vocab=60):
    generator = torch.Generator().manual_seed(0)
    states = torch.randn(rows, hidden, generator=generator).to(device, dtype)
    weight = (torch.randn(vocab, hidden, generator=generator) / hidden**0.5).to(device, dtype)
    ids = torch.stack([torch.randperm(vocab, generator=generator)[:top_k] for _ in range(rows)]).to(device)
    ids[7, 1] = ids[7, 0]  # a repeated candidate
    labels = torch.randint(0, vocab, (rows,), generator=generator).to(device)
    labels[::3] = ids[::3, 2]  # every third label is a candidate
    labels[7] = ids[7, 0]
    probs = torch.rand(rows, top_k, generator=generator) * torch.rand(rows, 1, generator=generator)
    probs[::4] = 0.0  # no teacher mass: the L1 term is off
    upstream = torch.randn(rows, generator=generator).to(device)
    return states, weight, ids, probs.to(device), labels, upstream


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_the_eager_terms(device, dtype):
    states, weight, ids, probs, labels, upstream = _inputs(device, dtype)
    results = []
    for fused in (False, True):
        leaf = states.clone().requires_grad_(True)
        if fused:
            ref, covered = liger_refinement_loss(leaf, weight, ids, probs, labels, CE_WEIGHT, THRESHOLD)
        else:
            ref, covered = refinement_terms(leaf, ids, probs, labels, weight, CE_WEIGHT, THRESHOLD)
        (ref * upstream).sum().backward()
        results.append((ref.detach(), covered, leaf.grad))
    (want_ref, want_covered, want_grad), (ref, covered, grad) = results
    assert ref.dtype == torch.float32 and grad.dtype == dtype
    assert covered.dtype == torch.bool and torch.equal(covered, want_covered)
    assert covered.any() and not covered.all()
    torch.testing.assert_close(ref, want_ref.float(), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(grad, want_grad, atol=2e-5, rtol=2e-5)


def test_leading_dimensions_and_a_second_backward(device):
    states, weight, ids, probs, labels, upstream = _inputs(device, torch.float32, rows=24)
    leaf = states.view(4, 6, -1).clone().requires_grad_(True)
    ref, covered = liger_refinement_loss(
        leaf, weight, ids.view(4, 6, -1), probs.view(4, 6, -1), labels.view(4, 6), CE_WEIGHT, THRESHOLD
    )
    assert ref.shape == covered.shape == (4, 6)
    loss = (ref * upstream.view(4, 6)).sum()
    loss.backward(retain_graph=True)
    first = leaf.grad.clone()
    leaf.grad = None
    loss.backward()
    torch.testing.assert_close(leaf.grad, first, rtol=0, atol=0)


def test_bad_arguments_are_named():
    states, weight, ids, probs, labels, _ = _inputs("cpu", torch.float64, rows=12)
    with pytest.raises(ValueError, match="liger-dspine: the refinement loss expects"):
        liger_refinement_loss(states, weight, ids, probs[:, :2], labels, CE_WEIGHT, THRESHOLD)
    with pytest.raises(ValueError, match="freeze it"):
        liger_refinement_loss(states, weight.requires_grad_(True), ids, probs, labels, CE_WEIGHT, THRESHOLD)
