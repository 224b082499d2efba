"""Packed rows in the DSpine objective: anchors, block labels and the draft's context stay inside one document."""

import torch

from liger_dspine.models.dspine import DSpineAccumulationWindow
from liger_dspine.models.dspine import DSpineDraftModel
from liger_dspine.models.dspine import DSpineObjective
from liger_dspine.models.dspine.blocks import block_targets
from liger_dspine.models.dspine.blocks import max_valid_anchor_count
from liger_dspine.models.dspine.blocks import sample_anchor_positions
from liger_dspine.models.dspine.masks import causal_block_mask
from tiny_dspine import TINY_MASK_TOKEN
from tiny_dspine import target_batch
from tiny_dspine import tiny_draft_config
from tiny_dspine import tiny_target

DOCUMENTS = torch.tensor([[0] * 4 + [1] * 6])  # a row of two packed documents, 4 and 6 tokens


def test_no_anchor_has_its_next_token_in_another_document():
    loss_mask = torch.ones(1, 10)
    anchors, keep = sample_anchor_positions(loss_mask, 100, document_ids=DOCUMENTS)
    assert anchors[keep].tolist() == [0, 1, 2, 4, 5, 6, 7, 8]  # 3 -> 4 crosses the boundary
    assert max_valid_anchor_count(loss_mask, DOCUMENTS) == 8 and max_valid_anchor_count(loss_mask) == 9


def test_a_document_ends_a_block_like_the_row_end():
    input_ids = torch.arange(10)[None]
    anchors, keep = torch.tensor([[2, 4, 8]]), torch.ones(1, 3, dtype=torch.bool)
    targets = block_targets(input_ids, torch.ones(1, 10), anchors, keep, 4, None, DOCUMENTS)
    assert targets.supervised.tolist() == [[[True, False, False], [True, True, True], [True, False, False]]]
    unpacked = block_targets(input_ids, torch.ones(1, 10), anchors, keep, 4, None)
    assert unpacked.supervised.tolist() == [[[True, True, True], [True, True, True], [True, False, False]]]


def test_the_draft_sees_only_its_document_of_the_context():
    anchors, keep = torch.tensor([[2, 7]]), torch.ones(1, 2, dtype=torch.bool)
    mask = causal_block_mask(anchors, keep, 10, 2, DOCUMENTS)[0, 0, :, :10]  # [N*b, S] context part
    assert mask[0].tolist() == [True, True] + [False] * 8  # anchor 2: keys 0, 1
    assert mask[2].tolist() == [False] * 4 + [True] * 3 + [False] * 3  # anchor 7: keys 4..6, not document 0
    plain = causal_block_mask(anchors, keep, 10, 2)[0, 0, :, :10]
    assert plain[2].tolist() == [True] * 7 + [False] * 3


def make_objective(target):
    torch.manual_seed(5)
    draft = DSpineDraftModel(tiny_draft_config())
    return DSpineObjective(draft, target.lm_head, target.model.embed_tokens, num_anchors=4).train()


def packed_batches(target):
    """A row whose first document (6 tokens) is unsupervised, and the same row with that document changed."""
    generator = torch.Generator().manual_seed(2)
    input_ids = torch.randint(0, TINY_MASK_TOKEN, (1, 16), generator=generator)
    loss_mask = torch.tensor([[0.0] * 6 + [1.0] * 10])
    changed_ids = input_ids.clone()
    changed_ids[:, :6] = torch.randint(0, TINY_MASK_TOKEN, (1, 6), generator=generator)
    batch = target_batch(target, input_ids, loss_mask).as_kwargs()
    changed = target_batch(target, changed_ids, loss_mask).as_kwargs()
    # the target saw each document alone: only the first document's states differ
    for key in ("hidden_states", "target_last_hidden_states"):
        changed[key] = torch.cat([changed[key][:, :6], batch[key][:, 6:]], dim=1)
    return batch, changed


def test_another_document_does_not_change_the_loss():
    target = tiny_target()
    objective = make_objective(target)
    batch, changed = packed_batches(target)
    documents = torch.tensor([[0] * 6 + [1] * 10])
    losses = {}
    for name, inputs in (("batch", batch), ("changed", changed)):
        for packed in (True, False):
            torch.manual_seed(3)
            extra = {"document_ids": documents} if packed else {}
            losses[name, packed] = objective(**inputs, **extra, global_step=5, total_steps=50).loss.item()
    assert losses["batch", True] == losses["changed", True]
    assert abs(losses["batch", False] - losses["changed", False]) > 1e-4


def test_accumulation_window_passes_document_ids():
    target = tiny_target()
    objective = make_objective(target)
    batch, _ = packed_batches(target)
    batch["document_ids"] = torch.tensor([[0] * 6 + [1] * 10])
    torch.manual_seed(3)
    expected = objective(**batch, global_step=5, total_steps=50).loss
    objective.zero_grad()
    window = DSpineAccumulationWindow(objective, accumulation_steps=1)
    torch.manual_seed(3)
    window.prepass(batch, global_step=5, total_steps=50)
    (replayed,) = window.replay()
    torch.testing.assert_close(replayed.loss, expected, rtol=1e-6, atol=0)
