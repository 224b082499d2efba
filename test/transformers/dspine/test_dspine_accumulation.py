"""DSpine accumulation window: prepass / replay equals the combined batch, reproduces draws, one all-reduce."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from liger_dspine.models.dspine import DSpineAccumulationWindow
from liger_dspine.models.dspine import DSpineDraftModel
from liger_dspine.models.dspine import DSpineObjective
from tiny_dspine import TINY_MASK_TOKEN
from tiny_dspine import target_batch
from tiny_dspine import tiny_draft_config
from tiny_dspine import tiny_target

SEQ = 12


def make_objective(target, seed=11, num_anchors=4):
    torch.manual_seed(seed)
    draft = DSpineDraftModel(tiny_draft_config())
    draft.initialize_transfer_space(target.lm_head.weight)
    with torch.no_grad():
        for write in draft.injection.writes:
            write.weight.normal_(0.0, 0.05)
    return DSpineObjective(
        draft, target.lm_head, target.model.embed_tokens, num_anchors=num_anchors, objective_chunk_blocks=2
    ).train()


def make_micro_batch(target, seed, batch=2, full_mask=False):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, TINY_MASK_TOKEN, (batch, SEQ), generator=generator)
    loss_mask = torch.ones(batch, SEQ)
    if not full_mask:
        loss_mask[:, : 1 + seed % 3] = 0
    return target_batch(target, input_ids, loss_mask).as_kwargs()


def grads_of(module):
    return {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}


def test_window_equals_the_combined_batch():
    """Every supervised position is an anchor (N >= S - 1, full masks) and no teacher forcing: the draws do not
    depend on the RNG, so two micro-batches of 2 rows equal one batch of 4 rows."""
    target = tiny_target()
    micro = [make_micro_batch(target, seed, full_mask=True) for seed in (1, 2)]
    combined = {key: torch.cat([m[key] for m in micro]) for key in micro[0]}

    reference = make_objective(target, num_anchors=SEQ)
    out = reference(**combined, global_step=100, total_steps=None)
    out.loss.backward()
    reference_grads = grads_of(reference.draft_model)

    objective = make_objective(target, num_anchors=SEQ)
    window = DSpineAccumulationWindow(objective, accumulation_steps=2)
    for batch in micro:
        window.prepass(batch, global_step=100, total_steps=None)
    outputs = window.replay()
    window_grads = grads_of(objective.draft_model)

    torch.testing.assert_close(outputs[0].alignment_ce, out.alignment_ce, atol=1e-6, rtol=1e-6)
    numerators = sum(o.loss_terms[0].detach() for o in outputs)
    denominators = sum(o.loss_terms[1] for o in outputs)
    torch.testing.assert_close(numerators / denominators, out.loss.detach(), atol=1e-6, rtol=2e-6)
    assert set(window_grads) == set(reference_grads)
    for name, grad in reference_grads.items():
        torch.testing.assert_close(window_grads[name], grad, atol=2e-5, rtol=2e-4, msg=name)


def test_replay_reproduces_draws_and_rng():
    target = tiny_target()
    objective = make_objective(target)
    draft = objective.draft_model
    seen = []
    original = draft.forward

    def spy(position_ids, attention_mask, noise_embedding, target_hidden, block_token_ids, replace_mask=None, **kw):
        seen.append((torch.is_grad_enabled(), position_ids.clone(), replace_mask))
        return original(
            position_ids, attention_mask, noise_embedding, target_hidden, block_token_ids, replace_mask, **kw
        )

    draft.forward = spy
    window = DSpineAccumulationWindow(objective, accumulation_steps=2)
    torch.manual_seed(123)
    for seed in (3, 4):
        window.prepass(make_micro_batch(target, seed), global_step=100, total_steps=600)
    state_after_prepasses = torch.get_rng_state()
    window.replay()
    assert torch.equal(torch.get_rng_state(), state_after_prepasses)
    assert [grad for grad, _, _ in seen] == [False, False, True, True]
    for prepass, replay in ((seen[0], seen[2]), (seen[1], seen[3])):
        assert torch.equal(prepass[1], replay[1])
        assert prepass[2] is not None and torch.equal(prepass[2], replay[2])
    assert not torch.equal(seen[0][2], seen[1][2]) or not torch.equal(seen[0][1], seen[1][1])


def test_window_misuse_raises():
    target = tiny_target()
    window = DSpineAccumulationWindow(make_objective(target), accumulation_steps=2)
    window.prepass(make_micro_batch(target, 1))
    with pytest.raises(RuntimeError, match="incomplete gradient accumulation"):
        window.replay()
    window.prepass(make_micro_batch(target, 2))
    with pytest.raises(RuntimeError, match="window is full"):
        window.prepass(make_micro_batch(target, 3))
    window.reset()
    with pytest.raises(ValueError, match="accumulation_steps"):
        DSpineAccumulationWindow(window.objective, accumulation_steps=0)


# ------------------------------------------------------------------------------------------------ two gloo ranks
WINDOWS = 2
ACCUMULATION = 2


def _gloo_worker(rank, world_size, store_path, results):
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
    try:
        torch.set_num_threads(1)
        target = tiny_target()
        objective = make_objective(target)
        window = DSpineAccumulationWindow(objective, accumulation_steps=ACCUMULATION)
        original_all_reduce = dist.all_reduce
        counts = []
        local_totals = []
        for step in range(WINDOWS):
            calls = []

            def counting_all_reduce(tensor, *args, **kwargs):
                calls.append(tuple(tensor.shape))
                return original_all_reduce(tensor, *args, **kwargs)

            dist.all_reduce = counting_all_reduce
            try:
                totals = torch.zeros(2)
                for micro in range(ACCUMULATION):
                    # Uneven masks per rank and micro-batch.
                    batch = make_micro_batch(target, seed=100 * rank + 10 * step + micro)
                    out = window.prepass(batch, global_step=100 + step, total_steps=600)
                    totals += torch.stack(out.ratio_metrics["dspine/backbone_ce"])
                outputs = window.replay()
            finally:
                dist.all_reduce = original_all_reduce
            counts.append(calls)
            local_totals.append((totals, outputs[0].alignment_ce))
        # Check the reduced value against every rank's local totals (collectives no longer counted).
        for totals, alignment_ce in local_totals:
            gathered = [torch.zeros(2) for _ in range(world_size)]
            dist.all_gather(gathered, totals)
            expected = sum(gathered)
            assert torch.allclose(alignment_ce, expected[0] / expected[1], atol=1e-6, rtol=1e-6)
        grad_norm = torch.stack([p.grad.norm() for p in objective.draft_model.parameters()]).norm()
        results.put((rank, counts, bool(torch.isfinite(grad_norm))))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # spawned gloo ranks: make test-slow
def test_one_all_reduce_per_window_on_two_gloo_ranks(tmp_path):
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.start_processes(
        _gloo_worker, args=(2, str(tmp_path / "store"), results), nprocs=2, join=True, start_method="spawn"
    )
    reports = sorted(results.get() for _ in range(2))
    for rank, counts, finite in reports:
        assert counts == [[(2,)]] * WINDOWS, f"rank {rank}: all-reduce calls per window {counts}"
        assert finite
