"""Drafting DSpine blocks at inference (``drafting.draft_blocks``): the plain argmax and the refined path.

References: the drafter's own forward on a block built by hand (plain), the sequential "refine under the chosen
predecessor, score the candidates, argmax" of dspine.md section 5.3 (refined), one block at a time with only the taps
before its anchor (what generation drafts) against many blocks in one forward (what the offline evaluation drafts),
and the Liger modules against the native ones.
"""

import pytest
import torch

from liger_dspine import apply_liger_kernel_to_dspine
from liger_dspine.models.dspine import DSpineDraftModel
from liger_dspine.models.dspine.drafting import draft_blocks
from liger_dspine.models.dspine.drafting import drafter_logits
from liger_dspine.models.dspine.drafting import proposal_states
from liger_dspine.models.dspine.masks import causal_block_mask
from liger_dspine.models.dspine.masks import draft_position_ids
from tiny_acceptance import one_thread
from tiny_dspine import TINY_MASK_TOKEN
from tiny_dspine import seeded_draft
from tiny_dspine import target_batch
from tiny_dspine import tiny_draft_config
from tiny_dspine import tiny_target

SEQ = 14
ANCHORS = [3, 6, 7, 11]


@pytest.fixture(autouse=True)
def single_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def setup():
    target = tiny_target()
    draft = seeded_draft(target, tiny_draft_config(), seed=5).eval()
    input_ids = torch.randint(0, TINY_MASK_TOKEN, (1, SEQ), generator=torch.Generator().manual_seed(9))
    taps = target_batch(target, input_ids).hidden_states
    positions = torch.tensor([ANCHORS])
    return target, draft, input_ids, taps, positions, input_ids[:, ANCHORS]


def test_plain_draft_is_the_argmax_of_the_drafters_logits_on_a_block_built_by_hand(setup):
    target, draft, input_ids, taps, positions, anchor_ids = setup
    drafted = draft_blocks(draft, target.model.embed_tokens, target.lm_head.weight, taps, positions, anchor_ids)
    for index, anchor in enumerate(ANCHORS):
        ids = torch.tensor([[int(input_ids[0, anchor])] + [TINY_MASK_TOKEN] * (draft.block_size - 1)])
        anchors = torch.tensor([[anchor]])
        with torch.no_grad():
            out = draft(
                draft_position_ids(anchors, SEQ, draft.block_size),
                causal_block_mask(anchors, torch.ones(1, 1, dtype=torch.bool), SEQ, draft.block_size),
                target.model.embed_tokens(ids),
                taps,
                ids[:, None],
            )
            expected = target.lm_head(out.hidden_states[0, 0, 1:]).argmax(dim=-1)
        assert torch.equal(drafted.plain[0, index], expected)


def test_refined_draft_is_the_sequential_refine_and_argmax_over_the_candidates(setup):
    target, draft, input_ids, taps, positions, anchor_ids = setup
    head = target.lm_head.weight
    drafted = draft_blocks(draft, target.model.embed_tokens, head, taps, positions, anchor_ids)
    states = proposal_states(draft, target.model.embed_tokens, taps, positions, anchor_ids)
    candidates = drafter_logits(states, head).topk(draft.dspine_config.top_k, dim=-1).indices  # [1, N, P, K]
    for block in range(len(ANCHORS)):
        predecessor = anchor_ids[0, block]
        for slot in range(draft.block_size - 1):
            with torch.no_grad():
                refined = draft.refine(states.pre_injection[0, block, slot], predecessor)
            scores = head[candidates[0, block, slot]] @ refined
            predecessor = candidates[0, block, slot, scores.argmax()]
            assert drafted.refined[0, block, slot] == predecessor, (block, slot)
    # the first proposal's predecessor is the anchor: refine gives the drafter's own state, so the refined and the
    # plain draft agree there
    assert torch.equal(drafted.refined[..., 0], drafted.plain[..., 0])


def test_many_blocks_in_one_forward_equal_each_block_drafted_from_the_taps_before_its_anchor(setup):
    target, draft, input_ids, taps, positions, anchor_ids = setup
    embed, head = target.model.embed_tokens, target.lm_head.weight
    together = draft_blocks(draft, embed, head, taps, positions, anchor_ids)
    for index, anchor in enumerate(ANCHORS):
        alone = draft_blocks(
            draft, embed, head, taps[:, :anchor], positions[:, index : index + 1], anchor_ids[:, [index]]
        )
        assert torch.equal(alone.plain[0, 0], together.plain[0, index])
        assert torch.equal(alone.refined[0, 0], together.refined[0, index])


def test_plain_only_skips_the_refinement(setup):
    target, draft, input_ids, taps, positions, anchor_ids = setup
    drafted = draft_blocks(
        draft, target.model.embed_tokens, target.lm_head.weight, taps, positions, anchor_ids, refine=False
    )
    assert drafted.refined is None and drafted.plain.shape == (1, len(ANCHORS), draft.block_size - 1)


def test_liger_modules_draft_as_the_native_ones(setup):
    """LigerRMSNorm and LigerSwiGLUMLP built in, then the attention and injection swapped in by the patch; fp32."""
    target, draft, input_ids, taps, positions, anchor_ids = setup
    liger = DSpineDraftModel(draft.config, use_liger_kernel=True).eval()
    liger.load_state_dict(draft.state_dict(), strict=True)
    report = apply_liger_kernel_to_dspine(model=liger)
    assert "LigerRMSNorm" in str(report) and "LigerAdjacentInjection" in str(report)
    embed, head = target.model.embed_tokens, target.lm_head.weight
    native_states = proposal_states(draft, embed, taps, positions, anchor_ids)
    liger_states = proposal_states(liger, embed, taps, positions, anchor_ids)
    torch.testing.assert_close(liger_states.hidden, native_states.hidden, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(liger_states.pre_injection, native_states.pre_injection, atol=2e-5, rtol=2e-5)
    native = draft_blocks(draft, embed, head, taps, positions, anchor_ids)
    patched = draft_blocks(liger, embed, head, taps, positions, anchor_ids)
    assert torch.equal(patched.plain, native.plain) and torch.equal(patched.refined, native.refined)
