"""Micro-batches and rows without a supervised token (prompt-only or padding rows): they contribute nothing.

fp32 native objective on the CPU; the tiny target and drafter of ``tiny_dspine``.
"""

import pytest
import torch

from liger_dspine.models.dspine import DSpineAccumulationWindow
from liger_dspine.models.dspine import DSpineDraftModel
from liger_dspine.models.dspine import DSpineObjective
from tiny_dspine import TINY_MASK_TOKEN
from tiny_dspine import target_batch
from tiny_dspine import tiny_draft_config
from tiny_dspine import tiny_target

SEQ = 12
STEP, TOTAL = 100, 600  # teacher forcing on (p = 0.5): the replacement draw uses the RNG too


def make_objective(target, num_anchors=4):
    torch.manual_seed(11)
    draft = DSpineDraftModel(tiny_draft_config())
    draft.initialize_transfer_space(target.lm_head.weight)
    with torch.no_grad():
        for write in draft.injection.writes:
            write.weight.normal_(0.0, 0.05)
    return DSpineObjective(draft, target.lm_head, target.model.embed_tokens, num_anchors=num_anchors).train()


def micro_batch(target, seed, rows=2, supervised=True):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, TINY_MASK_TOKEN, (rows, SEQ), generator=generator)
    loss_mask = torch.ones(rows, SEQ) if supervised else torch.zeros(rows, SEQ)
    if supervised:
        loss_mask[:, : 1 + seed % 3] = 0  # a prompt
    else:
        loss_mask[:, ::2] = 1  # supervised tokens, but never two in a row: no anchor
    return target_batch(target, input_ids, loss_mask).as_kwargs()


def run_window(target, micro_batches):
    """Prepass and replay one window from the same RNG state; returns (outputs, every drafter gradient, RNG after)."""
    objective = make_objective(target)
    window = DSpineAccumulationWindow(objective, accumulation_steps=len(micro_batches))
    torch.manual_seed(5)
    for batch in micro_batches:
        window.prepass(batch, global_step=STEP, total_steps=TOTAL)
    outputs = window.replay()
    grads = {
        name: torch.zeros_like(p) if p.grad is None else p.grad.clone()
        for name, p in objective.draft_model.named_parameters()
    }
    return outputs, grads, torch.get_rng_state()


def test_a_micro_batch_without_anchors_leaves_the_window_gradient_unchanged():
    """The empty micro-batch draws nothing and adds exact zeros: bit-equal gradients, loss and RNG."""
    target = tiny_target()
    first, second = micro_batch(target, 1), micro_batch(target, 2)
    empty = micro_batch(target, 3, supervised=False)
    outputs, grads, rng = run_window(target, [first, empty, second])
    reference_outputs, reference_grads, reference_rng = run_window(target, [first, second])

    assert [float(o.loss_terms[1]) for o in outputs] == [
        float(reference_outputs[0].loss_terms[1]),
        0.0,
        float(reference_outputs[1].loss_terms[1]),
    ]
    assert float(outputs[1].loss_terms[0].detach()) == 0.0
    assert torch.equal(outputs[0].alignment_ce, reference_outputs[0].alignment_ce)
    assert torch.equal(rng, reference_rng)
    assert any(bool(g.abs().sum() > 0) for g in reference_grads.values())
    for name, grad in reference_grads.items():
        assert torch.equal(grads[name], grad), name


def test_a_window_without_anchors_is_a_zero_loss_with_zero_gradients():
    target = tiny_target()
    outputs, grads, _ = run_window(target, [micro_batch(target, 3, supervised=False)] * 2)
    assert all(float(o.loss.detach()) == 0.0 and float(o.loss_terms[1]) == 0.0 for o in outputs)
    assert all(float(o.alignment_ce) == 0.0 for o in outputs)
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads.values())


def test_a_batch_without_anchors_outside_a_window_is_a_zero_loss_with_zero_gradients():
    target = tiny_target()
    objective = make_objective(target)
    state = torch.get_rng_state()
    out = objective(**micro_batch(target, 3, supervised=False), global_step=STEP, total_steps=TOTAL)
    assert torch.equal(torch.get_rng_state(), state)  # nothing drawn
    out.loss.backward()
    assert float(out.loss.detach()) == 0.0 and float(out.alignment_ce) == 0.0 and float(out.accuracy_denom) == 0.0
    trainable = [p for p in objective.parameters() if p.requires_grad]
    assert trainable and all(p.grad is not None and torch.equal(p.grad, torch.zeros_like(p)) for p in trainable)
    with torch.no_grad():
        prepass = objective(**micro_batch(target, 3, supervised=False), ce_only=True)
    assert [float(v) for v in prepass.loss_terms] == [0.0, 0.0]


def test_a_row_without_anchors_beside_a_supervised_row_changes_nothing():
    """Every valid position an anchor (N >= S) and no teacher forcing: the draws do not depend on the RNG, so the
    batch with an extra unsupervised row gives the supervised row's loss and gradients (fp32 summation order)."""
    target = tiny_target()
    supervised, empty = micro_batch(target, 1, rows=1), micro_batch(target, 3, rows=1, supervised=False)
    both = {key: torch.cat([supervised[key], empty[key]]) for key in supervised}
    results = []
    for batch in (supervised, both):
        objective = make_objective(target, num_anchors=SEQ)
        out = objective(**batch, global_step=STEP, total_steps=None)
        out.loss.backward()
        grads = {name: p.grad for name, p in objective.draft_model.named_parameters() if p.grad is not None}
        results.append((out, grads))
    (alone, alone_grads), (beside, beside_grads) = results
    assert torch.isfinite(beside.loss) and float(beside.loss_terms[1]) == float(alone.loss_terms[1])
    torch.testing.assert_close(beside.loss, alone.loss, atol=1e-6, rtol=1e-6)
    assert beside_grads.keys() == alone_grads.keys()
    for name, grad in alone_grads.items():
        torch.testing.assert_close(beside_grads[name], grad, atol=2e-6, rtol=1e-5, msg=name)


# ------------------------------------------------------------------------------------------------ two gloo ranks
def ddp_micro_batches(target) -> list[dict]:
    """Four micro-batches, the second without anchors; every valid position an anchor (N >= S) and no teacher
    forcing, so the draws do not depend on the RNG and any split over ranks sees the same blocks."""
    return [micro_batch(target, seed, supervised=seed != 1) for seed in range(4)]


def full_anchor_window_grads(objective, module, micro_batches, sync_context=None) -> dict:
    window = DSpineAccumulationWindow(module, accumulation_steps=len(micro_batches))
    for batch in micro_batches:
        window.prepass(batch, global_step=STEP, total_steps=None)
    window.replay(sync_context=sync_context)
    return {name: p.grad.clone() for name, p in objective.draft_model.named_parameters() if p.grad is not None}


def _ddp_rank_with_an_empty_last_micro_batch(rank, world_size):
    import contextlib

    target = tiny_target()
    objective = make_objective(target, num_anchors=SEQ)
    ddp = torch.nn.parallel.DistributedDataParallel(objective, broadcast_buffers=False)
    mine = ddp_micro_batches(target)[2 * rank : 2 * rank + 2]  # rank 0's last micro-batch is the empty one
    sync = lambda is_last: contextlib.nullcontext() if is_last else ddp.no_sync()  # noqa: E731
    return full_anchor_window_grads(objective, ddp, mine, sync)


@pytest.mark.slow  # spawned gloo ranks: make test-slow
def test_ddp_rank_whose_last_micro_batch_is_empty_still_reduces(tmp_path):
    """DDP reduces in the last micro-batch's backward: an empty one must still give every parameter a (zero)
    gradient. fp32: only the summation order differs from one process on the four micro-batches."""
    from spawned_ranks import run_on_gloo_ranks

    ranks = run_on_gloo_ranks(tmp_path, 2, _ddp_rank_with_an_empty_last_micro_batch, limit_s=300.0)
    target = tiny_target()
    objective = make_objective(target, num_anchors=SEQ)
    reference = full_anchor_window_grads(objective, objective, ddp_micro_batches(target))
    assert ranks.keys() == reference.keys()
    for name, grad in reference.items():
        torch.testing.assert_close(ranks[name], grad, atol=2e-6, rtol=1e-5, msg=name)
