"""Native DSpine drafter: forward against an fp64 reference, spine invariants, decoding helpers, masks."""

import math

import pytest
import torch
import torch.nn.functional as F

from liger_dspine.models.dspine import DSpineDraftModel
from liger_dspine.models.dspine.masks import causal_block_flex_mask
from liger_dspine.models.dspine.masks import causal_block_mask
from liger_dspine.models.dspine.masks import draft_position_ids
from tiny_dspine import TINY_MASK_TOKEN
from tiny_dspine import target_batch
from tiny_dspine import tiny_draft_config
from tiny_dspine import tiny_target

SEQ = 14
ANCHORS = torch.tensor([[1, 4, 8], [2, 6, 0]])
KEEP = torch.tensor([[True, True, True], [True, True, False]])


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def build_draft(target, seed=1, write_std=0.0, **config_overrides):
    torch.manual_seed(seed)
    draft = DSpineDraftModel(tiny_draft_config(**config_overrides))
    draft.initialize_transfer_space(target.lm_head.weight)
    if write_std:
        with torch.no_grad():
            for write in draft.injection.writes:
                write.weight.normal_(0.0, write_std)
            draft.injection.predecessor_gate.weight.normal_(0.0, 0.3)
            draft.injection.bias.normal_(0.0, 0.3)
    return draft


def draft_inputs(target, anchors=ANCHORS, keep=KEEP, seed=2):
    """Inputs of DSpineDraftModel.forward built as the training wrapper builds them."""
    generator = torch.Generator().manual_seed(seed)
    batch, num_blocks = anchors.shape
    block = 4
    input_ids = torch.randint(0, TINY_MASK_TOKEN, (batch, SEQ), generator=generator)
    captured = target_batch(target, input_ids)
    positions = (anchors[:, :, None] + torch.arange(block)).clamp(max=SEQ - 1)
    block_token_ids = input_ids.gather(1, positions.flatten(1)).view(batch, num_blocks, block)
    noise_ids = torch.full((batch, num_blocks, block), TINY_MASK_TOKEN)
    noise_ids[:, :, 0] = torch.where(keep, block_token_ids[:, :, 0], TINY_MASK_TOKEN)
    return dict(
        position_ids=draft_position_ids(anchors, SEQ, block),
        attention_mask={"full_attention": causal_block_mask(anchors, keep, SEQ, block)},
        noise_embedding=target.model.embed_tokens(noise_ids.flatten(1)),
        target_hidden=captured.hidden_states,
        block_token_ids=block_token_ids,
    )


# ------------------------------------------------------------------------------------------------ fp64 reference
def _rms(x, weight, eps):
    return weight.double() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def reference_forward(model, inputs, replace_mask=None, inject=True):
    """The drafter's math written out in fp64 from dspine.md sections 3.3-3.8."""
    config = model.config
    eps, d = config.rms_norm_eps, config.head_dim
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    r = model.injection.rank
    w = {k: v.double() for k, v in model.state_dict().items() if v.is_floating_point()}
    codes = model.transfer_codes.double()
    masks = {kind: mask[:, 0] for kind, mask in inputs["attention_mask"].items()}  # each [B, Q, K]
    block_ids = inputs["block_token_ids"]
    batch, num_blocks, block = block_ids.shape
    h = inputs["noise_embedding"].double()
    q_len = h.shape[1]
    ctx = _rms(inputs["target_hidden"].double() @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    inv_freq = 1.0 / (config.rope_parameters["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    angles = inputs["position_ids"].double()[..., None] * inv_freq
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]

    def feature(z, layer):
        return math.sqrt(r) * F.normalize(z @ w[f"injection.readouts.{layer}.weight"].T, dim=-1, eps=1e-12)

    def write(z, receiver, pred, layer):
        gate = torch.sigmoid(
            receiver @ w["injection.receiver_gate.weight"].T
            + pred @ w["injection.predecessor_gate.weight"].T
            + w["injection.bias"]
        )
        delta = (gate * (pred @ w["injection.message.weight"].T)) @ w[f"injection.writes.{layer}.weight"].T
        return z + z.norm(dim=-1, keepdim=True) / math.sqrt(z.shape[-1]) * delta

    features = []
    for layer in range(config.num_hidden_layers):
        p = f"layers.{layer}."
        mask = masks[config.layer_types[layer]]
        x = _rms(h, w[p + "input_layernorm.weight"], eps)
        kv = torch.cat([ctx, x], dim=1)
        q = _rms(
            (x @ w[p + "self_attn.q_proj.weight"].T).view(batch, q_len, heads, d), w[p + "self_attn.q_norm.weight"], eps
        )
        k = _rms(
            (kv @ w[p + "self_attn.k_proj.weight"].T).view(batch, -1, kv_heads, d),
            w[p + "self_attn.k_norm.weight"],
            eps,
        )
        v = (kv @ w[p + "self_attn.v_proj.weight"].T).view(batch, -1, kv_heads, d)
        q = _rotate(q.transpose(1, 2), cos[..., -q_len:, :], sin[..., -q_len:, :])
        k = _rotate(k.transpose(1, 2), cos, sin).repeat_interleave(heads // kv_heads, 1)
        v = v.transpose(1, 2).repeat_interleave(heads // kv_heads, 1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)
        scores = scores.masked_fill(~mask[:, None], -math.inf)
        attn = torch.nan_to_num(torch.softmax(scores, -1), nan=0.0) @ v  # fully masked rows -> 0
        h = h + attn.transpose(1, 2).reshape(batch, q_len, -1) @ w[p + "self_attn.o_proj.weight"].T
        y = _rms(h, w[p + "post_attention_layernorm.weight"], eps)
        mlp = F.silu(y @ w[p + "mlp.gate_proj.weight"].T) * (y @ w[p + "mlp.up_proj.weight"].T)
        h = h + mlp @ w[p + "mlp.down_proj.weight"].T
        u = h.view(batch, num_blocks, block, -1)
        pre = u
        if inject:
            slots = [u[:, :, 0]]
            for j in range(1, block):
                if replace_mask is not None and layer < model.injection.replacement_layers:
                    forced = math.sqrt(r) * codes[block_ids[:, :, j - 1]]
                else:
                    forced = None
                pred = math.sqrt(r) * codes[block_ids[:, :, 0]] if j == 1 else feature(u[:, :, j - 1], layer)
                if forced is not None:
                    pred = torch.where(replace_mask[..., None], forced, pred)
                slots.append(write(u[:, :, j], feature(u[:, :, j], layer), pred, layer))
            u = torch.stack(slots, dim=2)
        features.append(feature(u, layer))
        h = u.reshape(batch, q_len, -1)
    return _rms(h, w["norm.weight"], eps).view(batch, num_blocks, block, -1), pre, torch.stack(features)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("implementation", ["sdpa", "eager", "flex_attention"])
def test_forward_matches_fp64_reference(target, implementation):
    draft = build_draft(target, write_std=0.2, attn_implementation=implementation)
    inputs = draft_inputs(target)
    if implementation == "flex_attention":
        inputs["attention_mask"] = {"full_attention": causal_block_flex_mask(ANCHORS, KEEP, SEQ, 4)}
        reference_inputs = draft_inputs(target)
    else:
        reference_inputs = inputs
    with torch.no_grad():  # flex attention has no CPU backward
        out = draft(**inputs)
    hidden, pre, features = reference_forward(draft, reference_inputs)
    assert out.hidden_states.shape == (2, 3, 4, 32)
    assert out.layer_features.shape == (2, 2, 3, 4, 8)
    torch.testing.assert_close(out.hidden_states.double(), hidden, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(out.pre_injection.double(), pre, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(out.layer_features.double(), features, atol=2e-5, rtol=1e-5)


def test_replacement_matches_fp64_reference(target):
    draft = build_draft(
        target,
        write_std=0.2,
        dspine_config={"transfer_rank": 8, "message_size": 4, "top_k": 3, "replacement_layers": 1},
    )
    inputs = draft_inputs(target)
    replace = torch.tensor([[True, False, True], [False, True, False]])
    out = draft(**inputs, replace_mask=replace)
    hidden, _, features = reference_forward(draft, inputs, replace_mask=replace)
    torch.testing.assert_close(out.hidden_states.double(), hidden, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(out.layer_features.double(), features, atol=2e-5, rtol=1e-5)


def test_zero_writes_equal_the_backbone(target):
    """A fresh drafter (zero writes) is exactly the DFlash backbone: same layers, same final norm, no spine."""
    draft = build_draft(target)
    assert torch.count_nonzero(draft.injection.predecessor_gate.weight) == 0
    assert all(torch.count_nonzero(write.weight) == 0 for write in draft.injection.writes)
    inputs = draft_inputs(target)
    out = draft(**inputs)
    masks = draft._prepare_masks(inputs["attention_mask"])
    context = draft.hidden_norm(draft.fc(inputs["target_hidden"]))
    position_embeddings = draft.rotary_emb(inputs["noise_embedding"], inputs["position_ids"])
    hidden = inputs["noise_embedding"]
    for layer in draft.layers:
        hidden = layer(hidden, context, position_embeddings, masks["full_attention"])
    backbone = draft.norm(hidden)
    torch.testing.assert_close(out.hidden_states.flatten(1, 2), backbone, atol=0, rtol=0)
    # With zero writes, each layer's features are the pre-injection features.
    torch.testing.assert_close(out.layer_features[-1], draft.injection.feature(out.pre_injection, 1), atol=0, rtol=0)
    # And the fp64 reference without a spine agrees.
    reference, _, _ = reference_forward(draft, inputs, inject=False)
    torch.testing.assert_close(out.hidden_states.double(), reference, atol=2e-5, rtol=1e-5)


def test_dropped_blocks_are_finite_zero_attention(target):
    draft = build_draft(target, write_std=0.2)
    inputs = draft_inputs(target)
    out = draft(**inputs)
    assert torch.isfinite(out.hidden_states).all()
    out.hidden_states.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in draft.parameters() if p.grad is not None)


def test_prefix_isolation(target):
    draft = build_draft(target, write_std=0.1)
    inputs = draft_inputs(target)
    out = draft(**inputs)
    noise = inputs["noise_embedding"].clone()
    noise[:, 2:] += torch.randn_like(noise[:, 2:])
    perturbed = draft(**{**inputs, "noise_embedding": noise})
    torch.testing.assert_close(perturbed.hidden_states[:, 0, :2], out.hidden_states[:, 0, :2], atol=0, rtol=0)
    assert not torch.equal(perturbed.hidden_states[:, 0, 2:], out.hidden_states[:, 0, 2:])
    # Without replacement only the anchor token of block_token_ids is read.
    tokens = inputs["block_token_ids"].clone()
    tokens[..., 1:] = (tokens[..., 1:] + 7) % TINY_MASK_TOKEN
    same = draft(**{**inputs, "block_token_ids": tokens})
    torch.testing.assert_close(same.hidden_states, out.hidden_states, atol=0, rtol=0)
    torch.testing.assert_close(same.layer_features, out.layer_features, atol=0, rtol=0)


def test_replacement_scope(target):
    options = {"transfer_rank": 8, "message_size": 4, "top_k": 3, "replacement_layers": 1}
    draft = build_draft(target, write_std=0.2, dspine_config=options)
    inputs = draft_inputs(target)
    replace = torch.tensor([[True, False, True], [False, True, False]])
    normal = draft(**inputs)
    forced = draft(**inputs, replace_mask=replace)
    torch.testing.assert_close(forced.hidden_states[~replace], normal.hidden_states[~replace], atol=0, rtol=0)
    # Layer 0 features: anchor and slot 1 unchanged (slot 1's predecessor is the anchor either way), slots >= 2 differ.
    torch.testing.assert_close(
        forced.layer_features[0][replace][:, :2], normal.layer_features[0][replace][:, :2], atol=0, rtol=0
    )
    assert (forced.layer_features[0][replace][:, 2:] - normal.layer_features[0][replace][:, 2:]).abs().amin() > 0
    # The anchor slot is never written.
    torch.testing.assert_close(forced.hidden_states[..., 0, :], normal.hidden_states[..., 0, :], atol=0, rtol=0)


def test_injection_algebra(target):
    draft = build_draft(target, write_std=0.2)
    injection = draft.injection
    states = torch.randn(3, 5, 32)
    feature = injection.feature(states, 0)
    torch.testing.assert_close(feature.norm(dim=-1), torch.full((3, 5), math.sqrt(8)), atol=1e-5, rtol=0)
    receiver, predecessor = torch.randn(3, 5, 8), torch.randn(3, 5, 8)
    written = injection.write(states, receiver, predecessor, 1)
    gate = torch.sigmoid(injection.receiver_gate(receiver) + injection.predecessor_gate(predecessor) + injection.bias)
    delta = injection.writes[1](gate * injection.message(predecessor))
    rms = states.pow(2).mean(-1, keepdim=True).sqrt()  # no eps
    torch.testing.assert_close(written, states + rms * delta, atol=1e-6, rtol=1e-6)


def test_refine_of_zero_state_has_finite_gradients(target):
    draft = build_draft(target, write_std=0.2)
    hidden = torch.zeros(4, 32, requires_grad=True)
    refined = draft.refine(hidden, torch.tensor([1, 2, 3, 4]))
    refined.square().sum().backward()
    assert torch.isfinite(refined).all() and torch.isfinite(hidden.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in draft.parameters() if p.grad is not None)


def test_slot_one_refine_identity(target):
    """refine(pre_injection[..., 1, :], anchor) == hidden_states[..., 1, :] when the last layer is not forced."""
    draft = build_draft(target, write_std=0.2)
    inputs = draft_inputs(target)
    out = draft(**inputs)
    refined = draft.refine(out.pre_injection[..., 1, :], inputs["block_token_ids"][..., 0])
    torch.testing.assert_close(refined, out.hidden_states[..., 1, :], atol=1e-6, rtol=1e-6)


def test_transition_scores_and_select_cached(target):
    draft = build_draft(target, write_std=0.3)
    head = target.lm_head.weight
    generator = torch.Generator().manual_seed(3)
    pre = torch.randn(2, 3, 32, generator=generator)  # [batch, P', H]
    candidates = torch.randint(0, 96, (2, 3, 4), generator=generator)
    anchors = torch.tensor([5, 9])
    scores = draft.transition_scores(pre, candidates, anchors, head)
    assert scores.shape == (2, 3, 4, 4) and scores.dtype == torch.float32
    # Every row is a direct refine + dot product.
    for i in range(3):
        for k in range(4):
            pred = anchors if i == 0 else candidates[:, i - 1, k]
            direct = (draft.refine(pre[:, i], pred)[:, None, :] * head[candidates[:, i]]).sum(-1)
            torch.testing.assert_close(scores[:, i, k], direct, atol=1e-5, rtol=1e-5)
    # Greedy cached selection equals the sequential refine-score-argmax path.
    chosen = draft.select_cached(scores, candidates)
    for row in range(2):
        previous = anchors[row]
        for i in range(3):
            logits = draft.refine(pre[row, i], previous) @ head[candidates[row, i]].T
            previous = candidates[row, i, logits.argmax()]
            assert chosen[row, i] == previous


def test_transfer_space(target):
    draft = build_draft(target)
    codes = draft.transfer_codes
    assert not codes.requires_grad and bool(draft.transfer_ready)
    torch.testing.assert_close(codes.norm(dim=-1), torch.ones(96), atol=1e-5, rtol=0)
    readouts = [readout.weight for readout in draft.injection.readouts]
    torch.testing.assert_close(readouts[0], readouts[1], atol=0, rtol=0)
    # Readouts are the top principal directions of the centred unit rows (orthonormal); codes are whitened projections.
    units = F.normalize(target.lm_head.weight.double(), dim=-1)
    centred = units - units.mean(0)
    eigenvalues, eigenvectors = torch.linalg.eigh(centred.T @ centred)
    basis = readouts[0].double().T
    torch.testing.assert_close(basis.T @ basis, torch.eye(8, dtype=torch.float64), atol=1e-5, rtol=0)
    torch.testing.assert_close(
        (basis.T @ eigenvectors[:, -8:]).abs(), torch.eye(8, dtype=torch.float64), atol=1e-4, rtol=0
    )
    expected = F.normalize((centred @ basis) / eigenvalues[-8:].sqrt(), dim=-1)
    torch.testing.assert_close(codes.double(), expected, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="head weight of shape"):
        draft.initialize_transfer_space(target.lm_head.weight[:-1])
    with pytest.raises(ValueError, match="chunk_size"):
        draft.initialize_transfer_space(target.lm_head.weight, chunk_size=0)


def test_transfer_space_streams_over_chunks(target):
    one, many = build_draft(target), build_draft(target)
    one.initialize_transfer_space(target.lm_head.weight, chunk_size=4096)
    many.initialize_transfer_space(target.lm_head.weight, chunk_size=7)
    torch.testing.assert_close(one.transfer_codes, many.transfer_codes, atol=1e-5, rtol=0)


def test_uninitialised_transfer_space_fails(target):
    draft = DSpineDraftModel(tiny_draft_config())
    with pytest.raises(RuntimeError, match="transfer space"):
        draft(**draft_inputs(target))
    with pytest.raises(RuntimeError, match="transfer space"):
        draft.refine(torch.zeros(2, 32), torch.tensor([0, 1]))


def test_forward_argument_checks(target):
    draft = build_draft(target)
    inputs = draft_inputs(target)
    with pytest.raises(ValueError, match="KV cache"):
        draft(**inputs, use_cache=True)
    with pytest.raises(ValueError, match="attention mask"):
        draft(**{**inputs, "attention_mask": None})
    with pytest.raises(ValueError, match="block size"):
        draft(**{**inputs, "block_token_ids": inputs["block_token_ids"][..., :3]})
    with pytest.raises(ValueError, match="noise_embedding"):
        draft(**{**inputs, "noise_embedding": inputs["noise_embedding"][:, :-1]})


@pytest.mark.parametrize("liger", [False, True])
def test_gradient_checkpointing_does_not_change_loss_or_grads(target, liger):
    from liger_dspine import apply_liger_kernel_to_dspine

    inputs = draft_inputs(target)
    results, handed = [], []
    for checkpointing in (False, True):
        draft = build_draft(target, write_std=0.2).train()
        if liger:
            apply_liger_kernel_to_dspine(model=draft)
        if checkpointing:
            enable = getattr(draft, "activation_checkpointing_enable", None)
            if enable is not None:
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                draft.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            assert all(layer.gradient_checkpointing for layer in draft.layers)
            for layer in draft.layers:  # count the forwards each layer hands to the checkpoint function
                checkpoint = layer._gradient_checkpointing_func
                layer._gradient_checkpointing_func = lambda f, *a, c=checkpoint, **k: handed.append(f) or c(f, *a, **k)
        out = draft(**inputs)
        loss = out.hidden_states.square().mean() + out.layer_features.square().mean()
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in draft.named_parameters()}))
    assert len(handed) == len(draft.layers)  # checkpointing ran in every layer
    torch.testing.assert_close(results[0][0], results[1][0], atol=0, rtol=0)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, atol=1e-7, rtol=1e-6, msg=name)


def test_causal_block_mask_predicate():
    anchors, keep, seq, block = ANCHORS, KEEP, SEQ, 4
    mask = causal_block_mask(anchors, keep, seq, block)
    assert mask.shape == (2, 1, 12, seq + 12) and mask.dtype == torch.bool
    for b in range(2):
        for q in range(12):
            n, j = divmod(q, block)
            for k in range(seq + 12):
                in_context = k < seq and k < anchors[b, n]
                in_block = k >= seq and (k - seq) // block == n and (k - seq) % block <= j
                assert bool(mask[b, 0, q, k]) == (bool(keep[b, n]) and (in_context or in_block))


def test_position_ids():
    positions = draft_position_ids(ANCHORS, SEQ, 4)
    assert positions[0, :SEQ].tolist() == list(range(SEQ))
    assert positions[0, SEQ:].tolist() == [1, 2, 3, 4, 4, 5, 6, 7, 8, 9, 10, 11]
    assert positions[1, SEQ + 8 :].tolist() == [0, 1, 2, 3]  # dropped block: anchor 0
