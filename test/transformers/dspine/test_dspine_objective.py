"""DSpine training objective: per-row terms against references, masks and weights, prepass, chunking."""

import math

import pytest
import torch
import torch.nn.functional as F

from liger_dspine.models.dspine import DSpineDraftModel
from liger_dspine.models.dspine import DSpineObjective
from liger_dspine.models.dspine import frozen_head_terms as frozen_head_terms_module
from liger_dspine.models.dspine import objective as objective_module
from liger_dspine.models.dspine.blocks import block_targets
from liger_dspine.models.dspine.blocks import sample_anchor_positions
from liger_dspine.models.dspine.frozen_head_terms import frozen_head_terms
from liger_dspine.models.dspine.objective import refinement_terms
from tiny_dspine import TINY_MASK_TOKEN
from tiny_dspine import target_batch
from tiny_dspine import tiny_draft_config
from tiny_dspine import tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def make_objective(target, seed=5, chunk=3, num_anchors=4, **config_overrides):
    torch.manual_seed(seed)
    draft = DSpineDraftModel(tiny_draft_config(**config_overrides))
    draft.initialize_transfer_space(target.lm_head.weight)
    with torch.no_grad():
        for write in draft.injection.writes:
            write.weight.normal_(0.0, 0.05)
    objective = DSpineObjective(
        draft, target.lm_head, target.model.embed_tokens, num_anchors=num_anchors, objective_chunk_blocks=chunk
    )
    return objective.train()


def make_batch(target, seed=7, batch=2, seq=16, loss_mask=None):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, TINY_MASK_TOKEN, (batch, seq), generator=generator)
    if loss_mask is None:
        loss_mask = torch.ones(batch, seq)
        loss_mask[0, :3] = 0
        loss_mask[1, 10:12] = 0
    return target_batch(target, input_ids, loss_mask)


def run(objective, batch, seed=39, **kwargs):
    torch.manual_seed(seed)
    return objective(**batch.as_kwargs(), **kwargs)


# ------------------------------------------------------------------------------------------ frozen head terms
def test_frozen_head_terms_against_fp64_reference():
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(10, 16, generator=generator, requires_grad=True)
    teacher = torch.randn(10, 16, generator=generator)
    head = torch.randn(40, 16, generator=generator)
    labels = torch.randint(0, 40, (10,), generator=generator)
    terms = frozen_head_terms(hidden, head, labels, teacher, top_k=5)

    logits = hidden.double() @ head.double().T
    teacher_probs = torch.softmax(teacher.double() @ head.double().T, -1)
    ce = F.cross_entropy(logits, labels, reduction="none")
    l1 = (torch.softmax(logits, -1) - teacher_probs).abs().sum(-1)
    torch.testing.assert_close(terms.ce.double(), ce, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(terms.l1.double(), l1, atol=1e-5, rtol=1e-5)
    assert torch.equal(terms.candidate_ids, logits.topk(5, dim=-1).indices)
    torch.testing.assert_close(terms.candidate_teacher_probs.double(), teacher_probs.gather(-1, terms.candidate_ids))
    assert torch.equal(terms.correct, logits.argmax(-1) == labels)
    # Gradients reach the draft rows only.
    grad_ce, grad_l1 = torch.rand(10, generator=generator), torch.rand(10, generator=generator)
    (terms.ce * grad_ce + terms.l1 * grad_l1).sum().backward()
    hidden64 = hidden.detach().double().requires_grad_(True)
    logits64 = hidden64 @ head.double().T
    reference = (F.cross_entropy(logits64, labels, reduction="none") * grad_ce.double()).sum()
    reference = reference + ((torch.softmax(logits64, -1) - teacher_probs).abs().sum(-1) * grad_l1.double()).sum()
    reference.backward()
    torch.testing.assert_close(hidden.grad.double(), hidden64.grad, atol=1e-5, rtol=1e-5)
    # CE-only path: the same CE and nothing else.
    ce_only = frozen_head_terms(hidden.detach(), head, labels)
    assert ce_only.l1 is None and ce_only.candidate_ids is None and ce_only.candidate_teacher_probs is None
    torch.testing.assert_close(ce_only.ce, terms.ce.detach(), atol=0, rtol=0)


def test_refinement_terms_by_hand():
    head = torch.eye(4)  # candidate scores are then the refined state's coordinates
    refined = torch.tensor([[2.0, 0.0, 1.0, 0.0]])
    candidates = torch.tensor([[0, 2, 1]])
    teacher = torch.tensor([[0.5, 0.3, 0.1]])  # mass 0.9
    ref, covered = refinement_terms(refined, candidates, teacher, torch.tensor([2]), head, 0.1, 1e-4)
    log_probs = torch.log_softmax(torch.tensor([2.0, 1.0, 0.0]), -1)
    expected_ce = -log_probs[1]
    expected_l1 = (log_probs.exp() - teacher[0] / 0.9).abs().sum()
    torch.testing.assert_close(ref, (0.1 * expected_ce + 0.9 * expected_l1)[None])
    assert covered.tolist() == [True]
    # Label not among the candidates and teacher mass at or below the threshold: exactly zero.
    ref, covered = refinement_terms(refined, candidates, torch.full((1, 3), 1e-5), torch.tensor([3]), head, 0.1, 1e-4)
    assert ref.item() == 0.0 and covered.tolist() == [False]


# ---------------------------------------------------------------------------------------- anchors and weights
def test_anchor_sampling():
    torch.manual_seed(0)
    loss_mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1, 1, 1], [0] * 8 + [1, 1]]).float()
    anchors, keep = sample_anchor_positions(loss_mask, num_anchors=4)
    assert anchors.shape == (3, 4)
    assert keep.sum(1).tolist() == [3, 4, 1]  # min(valid count, N)
    assert sorted(anchors[0, :3].tolist()) == [1, 2, 5] and anchors[0, 3] == 0
    assert anchors[2, 0] == 8 and anchors[2, 1:].tolist() == [0, 0, 0]
    kept = anchors[1][keep[1]]
    assert torch.equal(kept, kept.sort().values) and len(set(kept.tolist())) == 4
    assert sample_anchor_positions(loss_mask, 4, max_valid_anchors=2)[0].shape == (3, 2)
    with pytest.raises(ValueError, match="two consecutive supervised tokens"):
        sample_anchor_positions(torch.tensor([[1.0, 0.0, 1.0, 0.0]]), 4)


def test_supervision_cumprod_and_position_decay():
    input_ids = torch.arange(10)[None]
    loss_mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 1, 1, 1]]).float()
    targets = block_targets(input_ids, loss_mask, torch.tensor([[1, 7]]), torch.tensor([[True, True]]), 4, 7.0)
    assert targets.labels.tolist() == [[[1, 2, 3, 4], [7, 8, 9, 9]]]
    assert targets.supervised.tolist() == [[[True, True, False], [True, True, False]]]
    torch.testing.assert_close(targets.weights[0, 0], torch.tensor([1.0, math.exp(-1 / 7), 0.0]))
    # gamma <= 0: plain 0/1 weights.
    flat = block_targets(input_ids, loss_mask, torch.tensor([[1, 7]]), torch.tensor([[True, False]]), 4, 0.0)
    assert flat.weights.tolist() == [[[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]]


def test_tail_after_a_mask_gap(target, monkeypatch):
    """Anchor 1 with loss_mask [0, 1, 1, 1, 0, ...]: D = 1 + e^(-1/7); states after the gap do not matter."""
    objective = make_objective(target, num_anchors=1, block_size=4)
    fixed = (torch.tensor([[1]]), torch.tensor([[True]]))
    monkeypatch.setattr(objective_module, "sample_anchor_positions", lambda *args: fixed)
    loss_mask = torch.zeros(1, 12)
    loss_mask[0, 1:4] = 1
    batch = make_batch(target, batch=1, seq=12, loss_mask=loss_mask)
    out = run(objective, batch, global_step=300, total_steps=600)
    assert out.loss_terms[1].item() == pytest.approx(1 + math.exp(-1 / 7), abs=1e-6)
    assert out.accuracy_denom.item() == 2
    changed = make_batch(target, batch=1, seq=12, loss_mask=loss_mask)
    changed.target_last_hidden_states[:, 4:] += torch.randn_like(changed.target_last_hidden_states[:, 4:])
    changed.hidden_states[:, 4:] += torch.randn_like(changed.hidden_states[:, 4:])
    again = run(objective, changed, global_step=300, total_steps=600)
    torch.testing.assert_close(again.loss, out.loss, atol=0, rtol=0)


# -------------------------------------------------------------------------------------------------- objective
@pytest.mark.parametrize("step", [100, 300])
def test_prepass_matches_the_full_objective_ce(target, monkeypatch, step):
    objective = make_objective(target)
    batch = make_batch(target)
    with torch.no_grad():
        full = run(objective, batch, global_step=step, total_steps=600)

    calls = {"draft": 0}
    objective.draft_model.register_forward_hook(lambda *_: calls.__setitem__("draft", calls["draft"] + 1))

    def forbidden(name):
        def fail(*args, **kwargs):
            raise AssertionError(f"the CE prepass called {name}")

        return fail

    for name in ("_teacher_probabilities", "_l1_distance", "_top_k_candidates"):
        monkeypatch.setattr(frozen_head_terms_module, name, forbidden(name))
    for name in ("refinement_terms", "alignment_terms", "global_mean_ce"):
        monkeypatch.setattr(objective_module, name, forbidden(name))
    monkeypatch.setattr(objective, "_objective_terms", forbidden("_objective_terms"))
    monkeypatch.setattr(objective.draft_model, "refine", forbidden("refine"))
    monkeypatch.setattr(torch.distributed, "all_reduce", forbidden("all_reduce"))
    monkeypatch.setattr(torch, "topk", forbidden("torch.topk"))
    with torch.no_grad():
        prepass = run(objective, batch, global_step=step, total_steps=600, ce_only=True)
    assert calls["draft"] == 1
    assert set(prepass.ratio_metrics) == {"dspine/backbone_ce"}
    torch.testing.assert_close(prepass.accuracy, full.accuracy, atol=0, rtol=0)
    torch.testing.assert_close(prepass.accuracy_denom, full.accuracy_denom, atol=0, rtol=0)
    for got, expected in zip(prepass.ratio_metrics["dspine/backbone_ce"], full.ratio_metrics["dspine/backbone_ce"]):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    assert prepass.loss_terms[0] is prepass.ratio_metrics["dspine/backbone_ce"][0]


def test_ce_only_refuses_autograd(target):
    objective = make_objective(target)
    with pytest.raises(ValueError, match="requires gradients to be disabled"):
        run(objective, make_batch(target), ce_only=True)


def test_loss_formula_from_its_terms(target):
    objective = make_objective(target)
    out = run(objective, make_batch(target), global_step=73, total_steps=600)
    metrics = {name: pair[0] for name, pair in out.ratio_metrics.items()}
    denominator = out.loss_terms[1]
    alignment_ce = metrics["dspine/backbone_ce"] / denominator  # single process: the local weighted mean
    torch.testing.assert_close(out.alignment_ce, alignment_ce)
    beta = 0.5 * 73 / 146
    numerator = (
        0.1 * metrics["dspine/backbone_ce"]
        + 0.9 * metrics["dspine/backbone_l1"]
        + metrics["dspine/refinement_loss"]
        + beta * alignment_ce * metrics["dspine/alignment_loss"]
    )
    torch.testing.assert_close(out.loss_terms[0].detach(), numerator)
    torch.testing.assert_close(out.loss.detach(), numerator / denominator.clamp_min(1))
    # A given alignment CE is used as is.
    given = run(objective, make_batch(target), global_step=73, total_steps=600, alignment_ce=torch.tensor(2.0))
    torch.testing.assert_close(
        given.loss_terms[0] - out.loss_terms[0], beta * (2.0 - alignment_ce) * metrics["dspine/alignment_loss"]
    )


def grads_of(module):
    return {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}


def test_chunking_does_not_change_loss_or_grads(target):
    batch = make_batch(target)
    results = []
    for chunk in (0, 1, 3):
        objective = make_objective(target, chunk=chunk)
        out = run(objective, batch, global_step=100, total_steps=600)
        out.loss.backward()
        results.append((out.loss.detach(), grads_of(objective.draft_model)))
        assert target.lm_head.weight.grad is None and target.model.embed_tokens.weight.grad is None
    reference_loss, reference_grads = results[0]
    assert len(reference_grads) == len(list(objective.draft_model.parameters()))
    for loss, grads in results[1:]:
        torch.testing.assert_close(loss, reference_loss, atol=1e-5, rtol=2e-4)
        for name, grad in reference_grads.items():
            torch.testing.assert_close(grads[name], grad, atol=2e-5, rtol=2e-4, msg=name)


def test_training_step_keeps_codes_and_frozen_tensors(target):
    objective = make_objective(target)
    draft = objective.draft_model
    codes = draft.transfer_codes.clone()
    head, embedding = target.lm_head.weight.clone(), target.model.embed_tokens.weight.clone()
    optimizer = torch.optim.SGD(draft.parameters(), lr=0.1)
    for step in range(2):
        out = run(objective, make_batch(target, seed=step), global_step=100 + step, total_steps=600)
        out.loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in draft.parameters())
        optimizer.step()
        optimizer.zero_grad()
    assert torch.equal(draft.transfer_codes, codes) and not draft.transfer_codes.requires_grad
    assert torch.equal(target.lm_head.weight, head) and torch.equal(target.model.embed_tokens.weight, embedding)
    assert target.lm_head.weight.grad is None


def test_refinement_gradient_reaches_the_last_layer_spine(target):
    objective = make_objective(target)
    out = run(objective, make_batch(target), global_step=0, total_steps=600)  # beta = 0: no alignment
    out.loss.backward()
    injection = objective.draft_model.injection
    for parameter in (injection.writes[-1].weight, injection.message.weight, injection.bias):
        assert parameter.grad.abs().sum() > 0


def test_replacement_draw_follows_the_schedule(target):
    objective = make_objective(target)
    seen = []
    objective.draft_model.register_forward_hook(lambda module, args, kwargs_or_out: None)
    original = objective.draft_model.forward

    def spy(*args, **kwargs):
        seen.append(args[5] if len(args) > 5 else kwargs.get("replace_mask"))
        return original(*args, **kwargs)

    objective.draft_model.forward = spy
    batch = make_batch(target)
    run(objective, batch, global_step=100, total_steps=600)
    run(objective, batch, global_step=300, total_steps=600)
    run(objective, batch, global_step=100, total_steps=None)
    objective.eval()
    run(objective, batch, global_step=100, total_steps=600)
    assert seen[0] is not None and seen[0].dtype == torch.bool and seen[0].shape == (2, 4)
    assert seen[1] is None and seen[2] is None and seen[3] is None


def test_objective_argument_checks(target):
    draft = make_objective(target).draft_model
    with pytest.raises(ValueError, match="block_size"):
        DSpineObjective(draft, target.lm_head, target.model.embed_tokens, block_size=5)
    with pytest.raises(ValueError, match="objective_chunk_blocks"):
        DSpineObjective(draft, target.lm_head, target.model.embed_tokens, objective_chunk_blocks=-1)
    fresh = DSpineDraftModel(tiny_draft_config())
    DSpineObjective(fresh, target.lm_head, target.model.embed_tokens)
    assert bool(fresh.transfer_ready)  # initialised from the head when not ready


@pytest.mark.parametrize("step", [100, 300])
def test_bf16_weights_with_fp32_codes_stay_finite(step):
    target = tiny_target(dtype=torch.bfloat16)
    objective = make_objective(target)
    draft = objective.draft_model.to(torch.bfloat16)
    draft.transfer_codes = draft.transfer_codes.float()
    out = run(objective, make_batch(target), global_step=step, total_steps=600)
    out.loss.backward()
    assert torch.isfinite(out.loss) and out.loss.dtype == torch.float32
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in draft.parameters())
    assert draft.transfer_codes.dtype == torch.float32


def test_a_target_head_or_embedding_of_another_vocabulary_is_refused_for_a_ready_drafter(target):
    draft = make_objective(target).draft_model
    assert bool(draft.transfer_ready)  # a loaded drafter: its transfer space is not built again from the head
    vocab, hidden = target.lm_head.weight.shape
    wider = torch.nn.Linear(hidden, vocab + 32, bias=False)
    with pytest.raises(ValueError, match=rf"target_lm_head weight is \[{vocab + 32}, {hidden}\].*vocabulary {vocab}"):
        DSpineObjective(draft, wider, target.model.embed_tokens)
    with pytest.raises(ValueError, match="target_embed_tokens weight"):
        DSpineObjective(draft, target.lm_head, torch.nn.Embedding(vocab - 8, hidden))
    with pytest.raises(ValueError, match=rf"mask_token_id must be a token id in \[0, {vocab}\), got {vocab}"):
        DSpineObjective(draft, target.lm_head, target.model.embed_tokens, mask_token_id=vocab)
    with pytest.raises(ValueError, match="num_anchors must be an int >= 1, got 0"):
        DSpineObjective(draft, target.lm_head, target.model.embed_tokens, num_anchors=0)


def test_inputs_that_do_not_fit_the_models_are_named(target):
    objective = make_objective(target)
    vocab = target.lm_head.weight.shape[0]
    generator = torch.Generator().manual_seed(2)
    batch = target_batch(target, torch.randint(0, vocab, (2, 12), generator=generator))
    good = dict(
        input_ids=batch.input_ids,
        hidden_states=batch.hidden_states,
        loss_mask=batch.loss_mask,
        target_last_hidden_states=batch.target_last_hidden_states,
    )
    out_of_vocabulary = batch.input_ids.clone()
    out_of_vocabulary[1, 3] = vocab + 4
    cases = [
        (dict(input_ids=out_of_vocabulary), rf"input_ids must be token ids in \[0, {vocab}\).*1 are outside"),
        (dict(hidden_states=batch.hidden_states[..., :-1]), "hidden_states must be"),
        (dict(loss_mask=batch.loss_mask[:, :6]), "loss_mask must be"),
        (dict(target_last_hidden_states=batch.target_last_hidden_states[:, :6]), "target_last_hidden_states must"),
        (dict(input_ids=batch.input_ids.float()), "input_ids must be \\[B, S\\] integer token ids"),
    ]
    for changed, message in cases:
        with pytest.raises(ValueError, match=message):
            objective(**{**good, **changed})
