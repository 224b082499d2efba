"""Sliding-window drafter layers (SpecForge's ``layer_types`` "sliding_attention"): config, masks, forward, training.

A draft slot j of a block anchored at a sits at position a + j; a sliding layer of window W sees the context keys
k < a with (a + j) - k < W and, unless the config leaves ``is_causal`` unset, the block's keys at offsets o <= j with
j - o < W.
"""

import json

import pytest
import torch
from test_dspine_modeling import ANCHORS
from test_dspine_modeling import KEEP
from test_dspine_modeling import SEQ
from test_dspine_modeling import build_draft
from test_dspine_modeling import draft_inputs
from test_dspine_modeling import reference_forward

from liger_dspine.models.dspine import DSpineDraftModel
from liger_dspine.models.dspine import DSpineObjective
from liger_dspine.models.dspine.configuration import DSpineDraftConfig
from liger_dspine.models.dspine.masks import causal_block_flex_mask
from liger_dspine.models.dspine.masks import causal_block_mask
from liger_dspine.models.dspine.masks import draft_attention_masks
from tiny_dspine import QWEN3_8B_DSPINE
from tiny_dspine import TINY_MASK_TOKEN
from tiny_dspine import target_batch
from tiny_dspine import tiny_draft_config
from tiny_dspine import tiny_target

SLIDING = dict(layer_types=["sliding_attention", "full_attention"], use_sliding_window=True, sliding_window=3)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def reference_visible(anchors, keep, seq, block, window, in_block, documents=None):
    """The predicate written out position by position: [B, N*b, S + N*b] bool."""
    batch, num_blocks = anchors.shape
    out = torch.zeros(batch, num_blocks * block, seq + num_blocks * block, dtype=torch.bool)
    for b in range(batch):
        for n in range(num_blocks):
            a = int(anchors[b, n])
            for j in range(block):
                if not keep[b, n]:
                    continue
                for k in range(seq):
                    seen = k < a and (window is None or (a + j) - k < window)
                    if documents is not None:
                        seen = seen and bool(documents[b, k] == documents[b, a])
                    out[b, n * block + j, k] = seen
                for o in range(block):
                    seen = o <= j and (window is None or not in_block or j - o < window)
                    out[b, n * block + j, seq + n * block + o] = seen
    return out


@pytest.mark.parametrize("window", [None, 1, 2, 3, 5, 100])
@pytest.mark.parametrize("in_block", [True, False])
@pytest.mark.parametrize("documents", [False, True])
def test_dense_mask_is_the_predicate(window, in_block, documents):
    generator = torch.Generator().manual_seed(3)
    seq, block = 16, 4
    anchors = torch.randint(0, seq - 1, (3, 4), generator=generator)
    keep = torch.rand(3, 4, generator=generator) > 0.3
    document_ids = torch.tensor([[0] * 5 + [1] * 11, [0] * 16, [0] * 8 + [1] * 4 + [2] * 4]) if documents else None
    mask = causal_block_mask(anchors, keep, seq, block, document_ids, window, in_block)
    expected = reference_visible(anchors, keep, seq, block, window, in_block, document_ids)
    assert torch.equal(mask[:, 0], expected)


@pytest.mark.parametrize("window", [1, 3, 6])
@pytest.mark.parametrize("in_block", [True, False])
def test_flex_mask_is_the_dense_mask(window, in_block):
    from torch.nn.attention.flex_attention import create_mask

    generator = torch.Generator().manual_seed(4)
    seq, block = 12, 4
    anchors = torch.randint(0, seq - 1, (2, 3), generator=generator)
    keep = torch.tensor([[True, False, True], [True, True, True]])
    dense = causal_block_mask(anchors, keep, seq, block, None, window, in_block)
    block_mask = causal_block_flex_mask(anchors, keep, seq, block, None, window, in_block)
    flex = create_mask(block_mask.mask_mod, 2, 1, 3 * block, seq + 3 * block, device="cpu")
    assert torch.equal(flex, dense)


def test_a_window_wider_than_every_distance_is_full_attention():
    anchors, keep = ANCHORS, KEEP
    full = causal_block_mask(anchors, keep, SEQ, 4)
    assert torch.equal(causal_block_mask(anchors, keep, SEQ, 4, None, SEQ + 4), full)
    assert not torch.equal(causal_block_mask(anchors, keep, SEQ, 4, None, 3), full)


@pytest.mark.parametrize("window", [0, -2, 2.5, True])
def test_a_bad_window_is_refused(window):
    with pytest.raises(ValueError, match="sliding_window"):
        causal_block_mask(ANCHORS, KEEP, SEQ, 4, None, window)


# ---------------------------------------------------------------------------------------------------------- config
def test_sliding_layers_load_from_a_specforge_config(tmp_path):
    config_dict = json.loads(json.dumps(QWEN3_8B_DSPINE))
    config_dict.update(
        use_sliding_window=True, sliding_window=2048, layer_types=["sliding_attention"] * 4 + ["full_attention"]
    )
    (tmp_path / "config.json").write_text(json.dumps(config_dict))
    config = DSpineDraftConfig.from_pretrained(tmp_path)
    assert config.layer_types == ["sliding_attention"] * 4 + ["full_attention"]
    assert config.sliding_window == 2048 and config.use_sliding_window is True
    config.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["layer_types"] == config.layer_types and saved["sliding_window"] == 2048
    assert DSpineDraftConfig.from_pretrained(tmp_path / "saved").layer_types == config.layer_types


def test_use_sliding_window_with_only_full_layers_loads():
    config = tiny_draft_config(use_sliding_window=True, sliding_window=8)
    assert config.layer_types == ["full_attention", "full_attention"]


@pytest.mark.parametrize(
    "overrides",
    [
        dict(layer_types=["sliding_attention", "full_attention"]),  # use_sliding_window false: no window
        dict(layer_types=["sliding_attention", "full_attention"], use_sliding_window=True, sliding_window=None),
        dict(layer_types=["sliding_attention", "full_attention"], use_sliding_window=True, sliding_window=0),
    ],
)
def test_sliding_layers_without_a_window_are_refused(overrides):
    with pytest.raises(ValueError, match="sliding_window"):
        tiny_draft_config(**overrides)


# ---------------------------------------------------------------------------------------------------------- model
def sliding_inputs(target, config, implementation="sdpa"):
    inputs = draft_inputs(target)
    config._attn_implementation = implementation
    inputs["attention_mask"] = draft_attention_masks(config, ANCHORS, KEEP, SEQ)
    return inputs


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("implementation", ["sdpa", "eager", "flex_attention"])
@pytest.mark.parametrize("is_causal", [True, None])
def test_forward_with_a_sliding_layer_matches_fp64_reference(target, implementation, is_causal):
    draft = build_draft(target, write_std=0.2, attn_implementation=implementation, is_causal=is_causal, **SLIDING)
    inputs = sliding_inputs(target, draft.config, implementation)
    reference_inputs = sliding_inputs(target, draft.config, "sdpa") if implementation == "flex_attention" else inputs
    draft.config._attn_implementation = implementation
    masks = reference_inputs["attention_mask"]
    assert set(masks) == {"sliding_attention", "full_attention"}
    assert not torch.equal(masks["sliding_attention"], masks["full_attention"])  # the window binds here
    with torch.no_grad():
        out = draft(**inputs)
    hidden, pre, features = reference_forward(draft, reference_inputs)
    torch.testing.assert_close(out.hidden_states.double(), hidden, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(out.pre_injection.double(), pre, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(out.layer_features.double(), features, atol=2e-5, rtol=1e-5)


def test_one_mask_for_a_drafter_with_sliding_layers_is_refused(target):
    draft = build_draft(target, **SLIDING)
    inputs = draft_inputs(target)
    inputs["attention_mask"] = causal_block_mask(ANCHORS, KEEP, SEQ, 4)
    with pytest.raises(ValueError, match="sliding_attention"):
        draft(**inputs)


def objective_step(target, draft, seed=11):
    objective = DSpineObjective(draft, target.lm_head, target.model.embed_tokens, num_anchors=3).train()
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, TINY_MASK_TOKEN, (2, 16), generator=generator)
    batch = target_batch(target, input_ids)
    torch.manual_seed(5)
    out = objective(**batch.as_kwargs(), global_step=10, total_steps=100)
    draft.zero_grad(set_to_none=True)
    out.loss.backward()
    return out.loss.detach(), {name: p.grad.clone() for name, p in draft.named_parameters() if p.grad is not None}


def test_objective_trains_sliding_layers_with_their_window(target):
    """The objective gives a sliding layer its window: the loss changes with W, and a window spanning every distance
    gives the all-full drafter's loss and gradients."""
    losses = {}
    for name, overrides in {
        "full": {},
        "wide": dict(SLIDING, sliding_window=64),
        "narrow": dict(SLIDING, sliding_window=2),
    }.items():
        draft = build_draft(target, seed=1, write_std=0.2, **overrides)
        draft.initialize_transfer_space(target.lm_head.weight)
        losses[name] = objective_step(target, draft)
    torch.testing.assert_close(losses["wide"][0], losses["full"][0], rtol=1e-6, atol=0)
    for name, grad in losses["full"][1].items():
        torch.testing.assert_close(losses["wide"][1][name], grad, rtol=1e-5, atol=1e-7, msg=name)
    assert abs(float(losses["narrow"][0] - losses["full"][0])) > 1e-4


def test_liger_drafter_with_a_sliding_layer_matches_native(target):
    native = build_draft(target, seed=1, write_std=0.2, **SLIDING)
    liger = DSpineDraftModel(native.config, use_liger_kernel=True)
    liger.load_state_dict(native.state_dict())
    loss_native, grads_native = objective_step(target, native)
    loss_liger, grads_liger = objective_step(target, liger)
    torch.testing.assert_close(loss_liger, loss_native, rtol=2e-5, atol=2e-5)
    assert set(grads_liger) == set(grads_native)
    for name, grad in grads_native.items():
        torch.testing.assert_close(grads_liger[name], grad, rtol=2e-5, atol=2e-5, msg=name)


@pytest.mark.cuda
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
# heads of 8, below the compiled flex kernel's 16: flex runs unfused, with a warning
@pytest.mark.filterwarnings("ignore:liger-dspine. DSpine flex attention with heads of 8")
@pytest.mark.parametrize("implementation", ["sdpa", "eager", "flex_attention"])
def test_forward_with_a_sliding_layer_matches_fp64_reference_cuda(target, implementation):
    draft = build_draft(target, write_std=0.2, is_causal=True, **SLIDING)
    hidden, pre, features = reference_forward(draft, sliding_inputs(target, draft.config, "sdpa"))
    draft.config._attn_implementation = implementation
    inputs = {name: value.cuda() for name, value in draft_inputs(target).items() if name != "attention_mask"}
    inputs["attention_mask"] = draft_attention_masks(draft.config, ANCHORS.cuda(), KEEP.cuda(), SEQ)
    with torch.no_grad():
        out = draft.cuda()(**inputs)
    torch.testing.assert_close(out.hidden_states.double().cpu(), hidden, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.pre_injection.double().cpu(), pre, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.layer_features.double().cpu(), features, atol=1e-4, rtol=1e-4)
