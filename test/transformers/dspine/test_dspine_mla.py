"""MLA drafters (``dflash_config.attention_mode: "mla"``): config, SpecForge key names, the attention against a
reference written here, eager / flex against sdpa, and save / reload.

The Liger side (built with ``use_liger_kernel=True`` or patched) is in test_dspine_mla_liger.py. Tolerances: 1e-5 for
fp32 against an fp32 reference of the same math (a few ulps of sums over at most 18 keys and 32 features).
"""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3Config

from liger_dspine.models.dspine import DSpineDraftConfig
from liger_dspine.models.dspine import DSpineDraftModel
from liger_dspine.models.dspine.attention import DSpineAttention
from liger_dspine.models.dspine.attention import prepare_mask
from liger_dspine.models.dspine.masks import causal_block_flex_mask
from liger_dspine.models.dspine.masks import causal_block_mask
from liger_dspine.models.dspine.masks import draft_position_ids
from liger_dspine.models.dspine.mla_attention import DSpineMLAAttention
from liger_dspine.models.dspine.mla_config import MLASettings
from liger_dspine.models.dspine.mla_config import mla_settings
from tiny_dspine import QWEN3_8B_DSPINE
from tiny_dspine import TINY_MASK_TOKEN
from tiny_dspine import TINY_MLA
from tiny_dspine import target_batch
from tiny_dspine import tiny_draft_config
from tiny_dspine import tiny_mla_draft_config
from tiny_dspine import tiny_target

SEQ, BLOCK = 10, 4
ANCHORS = torch.tensor([[1, 5], [2, 0]])
KEEP = torch.tensor([[True, True], [True, False]])  # the last block of row 1 is dropped: its rows see nothing


# ------------------------------------------------------------------------------------------------------ config
def specforge_mla_example() -> dict:
    """SpecForge's MLA example (docs/advanced_features/customization.md) on the Qwen3-8B DSpine config. The example's
    ``projector_type: "dspark"`` belongs to DSpark drafters; a DSpine drafter has none."""
    config = json.loads(json.dumps(QWEN3_8B_DSPINE))
    config.update(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    config["dflash_config"].update(attention_mode="mla", mla_rope_interleaved=True, mla_use_output_gate=False)
    return config


def test_specforge_mla_example_config_loads_and_builds_specforge_shapes(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(specforge_mla_example()))
    config = DSpineDraftConfig.from_pretrained(tmp_path)
    assert config.uses_mla and config.dflash_config["attention_mode"] == "mla"
    assert mla_settings(config) == MLASettings(1536, 512, 128, 64, 128, rope_interleaved=True, output_gate=False)
    with torch.device("meta"):
        model = DSpineDraftModel(config)
    attention = {k: tuple(v.shape) for k, v in model.state_dict().items() if k.startswith("layers.0.self_attn.")}
    assert attention == {
        "layers.0.self_attn.q_a_proj.weight": (1536, 4096),
        "layers.0.self_attn.q_a_layernorm.weight": (1536,),
        "layers.0.self_attn.q_b_proj.weight": (32 * 192, 1536),
        "layers.0.self_attn.kv_a_proj_with_mqa.weight": (512 + 64, 4096),
        "layers.0.self_attn.kv_a_layernorm.weight": (512,),
        "layers.0.self_attn.kv_b_proj.weight": (32 * (128 + 128), 512),
        "layers.0.self_attn.o_proj.weight": (4096, 32 * 128),
    }
    assert model.layers[4].self_attn.scaling == 192**-0.5
    assert tuple(model.rotary_emb.inv_freq.shape) == (32,)  # one frequency per rope pair, not per head_dim pair


def test_rotary_embedding_has_the_rope_width_and_theta():
    model = DSpineDraftModel(tiny_mla_draft_config(rope_parameters={"rope_type": "default", "rope_theta": 5e5}))
    expected = 1.0 / (5e5 ** (torch.arange(0, 4, 2, dtype=torch.float32) / 4))
    torch.testing.assert_close(model.rotary_emb.inv_freq, expected, atol=0, rtol=0)
    cos, sin = model.rotary_emb(torch.zeros(1, 3, 32), torch.arange(3)[None])
    assert cos.shape == sin.shape == (1, 3, 4)


@pytest.mark.parametrize("field", ["kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"])
def test_a_missing_mla_field_is_named(field):
    config_dict = tiny_mla_draft_config().to_dict()
    del config_dict[field]
    with pytest.raises(ValueError, match=f"needs {field}") as error:
        DSpineDraftConfig.from_dict(config_dict)
    assert str(error.value).startswith("DSpine")


@pytest.mark.parametrize(
    "overrides, named",
    [
        ({"q_lora_rank": 0}, "q_lora_rank must be an int >= 1"),
        ({"kv_lora_rank": 0}, "kv_lora_rank must be an int >= 1"),
        ({"kv_lora_rank": 8.0}, "kv_lora_rank must be an int >= 1"),
        ({"qk_nope_head_dim": -1}, "qk_nope_head_dim must be an int >= 0"),
        ({"qk_rope_head_dim": 0}, "qk_rope_head_dim must be an int >= 1"),
        ({"qk_rope_head_dim": 3}, "qk_rope_head_dim must be even"),
        ({"v_head_dim": 0}, "v_head_dim must be an int >= 1"),
        ({"v_head_dim": True}, "v_head_dim must be an int >= 1"),
    ],
)
def test_an_invalid_mla_field_is_named(overrides, named):
    with pytest.raises(ValueError, match=named) as error:
        tiny_mla_draft_config(**overrides)
    assert str(error.value).startswith("DSpine")


def mla_dflash(**options) -> dict:
    return {"mask_token_id": TINY_MASK_TOKEN, "target_layer_ids": [0, 2], **options}


@pytest.mark.parametrize(
    "dflash, top_level, named",
    [
        ({"mla_rope_interleaved": "yes"}, {}, "mla_rope_interleaved must be a bool"),
        ({"mla_use_output_gate": 1}, {}, "mla_use_output_gate must be a bool"),
        ({}, {"rope_interleave": "no"}, "mla_rope_interleaved must be a bool"),  # the top-level fallback
        ({"attention_modes": ["mla", "gqa"]}, {}, r"'mla' cannot be mixed with \['gqa'\]"),
        ({"attention_mode": "mla"}, {"attention_mode": "mha"}, r"'mla' cannot be mixed with \['mha'\]"),
    ],
)
def test_invalid_mla_options_are_named(dflash, top_level, named):
    dflash = {"attention_mode": "mla", **dflash} if "attention_modes" not in dflash else dflash
    with pytest.raises(ValueError, match=named) as error:
        tiny_draft_config(**TINY_MLA, **top_level, num_key_value_heads=4, dflash_config=mla_dflash(**dflash))
    assert str(error.value).startswith("DSpine")


@pytest.mark.parametrize(
    "dflash, top_level, interleaved, gate",
    [
        ({}, {}, True, False),  # SpecForge's defaults
        ({}, {"rope_interleave": False, "mla_use_output_gate": True}, False, True),  # top-level fallbacks
        ({"mla_rope_interleaved": True, "mla_use_output_gate": False}, {"rope_interleave": False}, True, False),
        ({"attention_modes": ["mla", "MLA"]}, {}, True, False),  # one mode per layer, all MLA
    ],
)
def test_mla_option_defaults(dflash, top_level, interleaved, gate):
    dflash = dflash if "attention_modes" in dflash else {"attention_mode": "mla", **dflash}
    config = tiny_draft_config(**TINY_MLA, **top_level, dflash_config=mla_dflash(**dflash))
    settings = mla_settings(config)
    assert config.uses_mla and (settings.rope_interleaved, settings.output_gate) == (interleaved, gate)
    assert (settings.q_lora_rank, settings.kv_lora_rank, settings.qk_head_dim, settings.v_head_dim) == (12, 8, 16, 16)


@pytest.mark.parametrize("mode", [None, "gqa", "mha"])
def test_gqa_and_mha_ignore_mla_fields(mode):
    """MLA fields without attention_mode "mla" change nothing: the same modules, keys and rotary width as before."""
    dflash = mla_dflash() if mode is None else mla_dflash(attention_mode=mode)
    plain = DSpineDraftModel(tiny_draft_config(num_key_value_heads=4, dflash_config=dflash))
    with_fields = DSpineDraftModel(tiny_draft_config(num_key_value_heads=4, dflash_config=dflash, **TINY_MLA))
    for model in (plain, with_fields):
        assert not model.config.uses_mla
        assert all(type(layer.self_attn) is DSpineAttention for layer in model.layers)
        assert tuple(model.rotary_emb.inv_freq.shape) == (4,)  # head_dim 8
    assert {k: v.shape for k, v in with_fields.state_dict().items()} == {
        k: v.shape for k, v in plain.state_dict().items()
    }


# --------------------------------------------------------------------------------------------------- key names
def mla_attention_shapes(layer: int, q_lora_rank, gate: bool, bias: bool) -> dict:
    """SpecForge's Qwen3DFlashMLAAttention keys, in its order, at the tiny sizes (4 heads, nope 12, rope 4, v 16,
    H 32); every projection but the gate takes ``attention_bias``."""
    if q_lora_rank is None:
        modules = [("q_proj", (64, 32))]
    else:
        modules = [("q_a_proj", (12, 32)), ("q_a_layernorm", (12,)), ("q_b_proj", (64, 12))]
    modules += [("kv_a_proj_with_mqa", (8 + 4, 32)), ("kv_a_layernorm", (8,)), ("kv_b_proj", (4 * (12 + 16), 8))]
    modules += [("g_proj", (64, 32))] if gate else []
    modules += [("o_proj", (32, 64))]
    shapes = {}
    for name, shape in modules:
        shapes[f"layers.{layer}.self_attn.{name}.weight"] = shape
        if bias and len(shape) == 2 and name != "g_proj":
            shapes[f"layers.{layer}.self_attn.{name}.bias"] = shape[:1]
    return shapes


@pytest.mark.parametrize("q_lora_rank", [12, None], ids=["low_rank_query", "direct_query"])
@pytest.mark.parametrize("gate", [False, True], ids=["no_gate", "gate"])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_state_dict_keys_are_specforge_names(q_lora_rank, gate, bias):
    config = tiny_mla_draft_config(output_gate=gate, q_lora_rank=q_lora_rank, attention_bias=bias)
    shapes = {k: tuple(v.shape) for k, v in DSpineDraftModel(config).state_dict().items()}
    gqa = {k: tuple(v.shape) for k, v in DSpineDraftModel(tiny_draft_config()).state_dict().items()}
    # the rest of the drafter is unchanged
    assert {k: v for k, v in shapes.items() if ".self_attn." not in k} == {
        k: v for k, v in gqa.items() if ".self_attn." not in k
    }
    expected = {k: v for i in range(2) for k, v in mla_attention_shapes(i, q_lora_rank, gate, bias).items()}
    attention = {k: v for k, v in shapes.items() if ".self_attn." in k}
    assert attention == expected and list(attention) == list(expected)


# --------------------------------------------------------------------------------------------- reference math
def reference_mla(attention, config, x, context, position_ids, mask):
    """SpecForge's Qwen3DFlashMLAAttention written out in plain torch: context and draft projected separately, RoPE
    angles from rope_theta, interleaved RoPE as complex products of the pairs, a softmax over visible keys only.

    x [B, Q, H], context [B, S, H], position_ids [B, S+Q], mask bool [B, 1, Q, S+Q] -> [B, Q, H].
    """
    s = mla_settings(config)
    w = dict(attention.named_parameters())
    heads, nope, rope, v_dim = config.num_attention_heads, s.qk_nope_head_dim, s.qk_rope_head_dim, s.v_head_dim
    batch, q_len, _ = x.shape
    eps = config.rms_norm_eps

    def linear(t, name):
        return t @ w[name + ".weight"].T + (w[name + ".bias"] if name + ".bias" in w else 0)

    def rms(t, name):
        return w[name + ".weight"] * (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps))

    def turn(t, angles):  # t [B, T, n, R], angles [B, T, R/2]
        if s.rope_interleaved:
            pairs = torch.view_as_complex(t.unflatten(-1, (-1, 2)).contiguous())
            return torch.view_as_real(pairs * torch.polar(torch.ones_like(angles), angles)[:, :, None]).flatten(-2)
        first, second = t[..., : rope // 2], t[..., rope // 2 :]
        cos, sin = angles.cos()[:, :, None], angles.sin()[:, :, None]
        return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)

    def keys_values(t):
        latent_rope = linear(t, "kv_a_proj_with_mqa")
        latent, k_rot = latent_rope[..., : s.kv_lora_rank], latent_rope[..., s.kv_lora_rank :]
        kv = linear(rms(latent, "kv_a_layernorm"), "kv_b_proj").view(batch, t.shape[1], heads, nope + v_dim)
        return kv[..., :nope], k_rot[:, :, None], kv[..., nope:]

    if s.q_lora_rank is None:
        query = linear(x, "q_proj")
    else:
        query = linear(rms(linear(x, "q_a_proj"), "q_a_layernorm"), "q_b_proj")
    query = query.view(batch, q_len, heads, nope + rope)
    (ck, cr, cv), (dk, dr, dv) = keys_values(context), keys_values(x)
    inv_freq = config.rope_parameters["rope_theta"] ** (-torch.arange(0, rope, 2, dtype=torch.float32) / rope)
    angles = position_ids[..., None].float() * inv_freq  # [B, S+Q, R/2]
    q = torch.cat([query[..., :nope], turn(query[..., nope:], angles[:, -q_len:])], dim=-1)
    k_rot = turn(torch.cat([cr, dr], dim=1), angles).expand(-1, -1, heads, -1)
    k = torch.cat([torch.cat([ck, dk], dim=1), k_rot], dim=-1)
    v = torch.cat([cv, dv], dim=1)
    scores = torch.einsum("bqnd,bknd->bnqk", q, k) * (nope + rope) ** -0.5
    visible = mask.any(-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")).masked_fill(~visible, 0.0), dim=-1) * visible
    out = torch.einsum("bnqk,bknd->bqnd", probs, v)
    if s.output_gate:
        out = out * torch.sigmoid(x @ w["g_proj.weight"].T).view(batch, q_len, heads, v_dim)
    return linear(out.reshape(batch, q_len, -1), "o_proj")


VARIANTS = {
    "low_rank_query_gate": dict(output_gate=True),
    "direct_query": dict(output_gate=False, q_lora_rank=None),
    "no_nope_bias": dict(output_gate=True, qk_nope_head_dim=0, attention_bias=True),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "rotate_half"])
def test_mla_attention_matches_the_reference(interleaved, variant):
    torch.manual_seed(3)
    config = tiny_mla_draft_config(rope_interleaved=interleaved, **VARIANTS[variant])
    model = DSpineDraftModel(config)
    attention = model.layers[0].self_attn
    assert type(attention) is DSpineMLAAttention and attention.rope_interleaved is interleaved
    with torch.no_grad():
        for parameter in attention.parameters():
            parameter.normal_(0.0, 0.3)
    x = torch.randn(2, 2 * BLOCK, 32, requires_grad=True)
    context = torch.randn(2, SEQ, 32, requires_grad=True)
    position_ids = draft_position_ids(ANCHORS, SEQ, BLOCK)
    mask = causal_block_mask(ANCHORS, KEEP, SEQ, BLOCK)
    out = attention(x, context, model.rotary_emb(x, position_ids), prepare_mask(mask))
    expected = reference_mla(attention, config, x, context, position_ids, mask)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # the dropped block's rows: no attention output, only o_proj's bias
    torch.testing.assert_close(out[1, BLOCK:], attention.o_proj(torch.zeros(BLOCK, 64)), atol=0, rtol=0)
    cotangent = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, context, *attention.parameters()], cotangent)
    expected_grads = torch.autograd.grad(expected, [x, context, *attention.parameters()], cotangent)
    for name, grad, expected_grad in zip(["x", "context", *dict(attention.named_parameters())], grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, atol=1e-5, rtol=1e-5, msg=name)


# ---------------------------------------------------------------------------------------- eager / flex vs sdpa
@pytest.fixture(scope="module")
def target():
    return tiny_target()


def drafter_inputs(target):
    generator = torch.Generator().manual_seed(4)
    input_ids = torch.randint(0, TINY_MASK_TOKEN, (2, SEQ), generator=generator)
    positions = (ANCHORS[:, :, None] + torch.arange(BLOCK)).clamp(max=SEQ - 1)
    block_token_ids = input_ids.gather(1, positions.flatten(1)).view(2, 2, BLOCK)
    noise_ids = torch.full((2, 2, BLOCK), TINY_MASK_TOKEN)
    noise_ids[:, :, 0] = torch.where(KEEP, block_token_ids[:, :, 0], TINY_MASK_TOKEN)
    return dict(
        position_ids=draft_position_ids(ANCHORS, SEQ, BLOCK),
        attention_mask={"full_attention": causal_block_mask(ANCHORS, KEEP, SEQ, BLOCK)},
        noise_embedding=target.model.embed_tokens(noise_ids.flatten(1)),
        target_hidden=target_batch(target, input_ids).hidden_states,
        block_token_ids=block_token_ids,
    )


def mla_drafter(target, implementation, interleaved=True):
    torch.manual_seed(6)
    draft = DSpineDraftModel(tiny_mla_draft_config(rope_interleaved=interleaved, attn_implementation=implementation))
    draft.initialize_transfer_space(target.lm_head.weight)
    with torch.no_grad():
        for write in draft.injection.writes:
            write.weight.normal_(0.0, 0.2)
    return draft


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("implementation", ["eager", "flex_attention"])
def test_eager_and_flex_give_the_sdpa_drafter(target, implementation):
    inputs = drafter_inputs(target)
    sdpa, other = mla_drafter(target, "sdpa"), mla_drafter(target, implementation)
    assert other.config._attn_implementation == implementation
    other_inputs = dict(inputs)
    if implementation == "flex_attention":
        other_inputs["attention_mask"] = {"full_attention": causal_block_flex_mask(ANCHORS, KEEP, SEQ, BLOCK)}
    with torch.no_grad():  # flex attention has no CPU backward
        expected, out = sdpa(**inputs), other(**other_inputs)
    for name in ("hidden_states", "pre_injection", "layer_features"):
        torch.testing.assert_close(getattr(out, name), getattr(expected, name), atol=1e-5, rtol=1e-5, msg=name)
    if implementation == "eager":
        grads = []
        for model in (sdpa, other):
            model(**inputs).hidden_states.square().sum().backward()
            grads.append({n: p.grad for n, p in model.named_parameters()})
        for name, grad in grads[0].items():  # the two attention paths sum in different orders: fp32 rounding
            torch.testing.assert_close(grads[1][name], grad, atol=5e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


# ------------------------------------------------------------------------------------------- save / reload
def test_save_pretrained_round_trip_writes_the_specforge_layout(tmp_path):
    torch.manual_seed(0)
    model = DSpineDraftModel(tiny_mla_draft_config(q_lora_rank=None))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
        model.transfer_codes.normal_()
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "qwen3" and saved["architectures"] == ["DSpineDraftModel"]
    assert {k: saved[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim")} == {
        "q_lora_rank": None,
        "kv_lora_rank": 8,
        "qk_nope_head_dim": 12,
        "qk_rope_head_dim": 4,
    }
    assert saved["v_head_dim"] == 16
    assert saved["dflash_config"] == {
        "mask_token_id": TINY_MASK_TOKEN,
        "target_layer_ids": [0, 2],
        "attention_mode": "mla",
        "mla_rope_interleaved": True,
        "mla_use_output_gate": True,
    }
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert set(tensors) == set(model.state_dict())
    assert tensors["layers.1.self_attn.kv_a_proj_with_mqa.weight"].shape == (12, 32)

    loaded = DSpineDraftModel.from_pretrained(tmp_path)
    assert type(loaded.layers[0].self_attn) is DSpineMLAAttention
    assert loaded.config.to_dict() | {"_name_or_path": ""} == model.config.to_dict() | {"_name_or_path": ""}
    assert list(loaded.state_dict()) == list(model.state_dict())
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    # SpecForge reads the file as a Qwen3Config; that object builds the same drafter and loads the weights strictly
    specforge = DSpineDraftModel(Qwen3Config.from_dict(saved))
    assert specforge.config.uses_mla and mla_settings(specforge.config) == mla_settings(model.config)
    specforge.load_state_dict(tensors, strict=True)


# ------------------------------------------------------------------------------------------------ train-drafter
def parse_train_drafter(*argv):
    import argparse

    from liger_dspine.drafter_training.options import add_arguments
    from liger_dspine.drafter_training.options import resolve

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return resolve(parser.parse_args(["--tiny", "--no-liger", *argv]))


@pytest.mark.slow  # a train-drafter run: make test-slow
def test_train_drafter_mla_takes_the_target_sizes_and_trains(tmp_path):
    """--tiny's target is a DeepSeek-V3 (q_lora_rank 32, kv_lora_rank 32, nope 16, rope 8, v 16): the MLA drafter
    takes its sizes; 20 fp32 CPU steps lower the loss and write a checkpoint that checks and reloads as MLA."""
    from liger_dspine.drafter_training.loop import train_drafter
    from liger_dspine.models.dspine.checkpoint import check_checkpoint

    args = parse_train_drafter("--drafter-attention", "mla", "--steps", "20", "--output-dir", str(tmp_path))
    history = train_drafter(args)
    losses = [m["loss"] for m in history]
    assert len(losses) == 20 and all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-5:]) / 5 < 0.95 * sum(losses[:5]) / 5, losses
    folder = tmp_path / "checkpoint-20"
    assert check_checkpoint(folder).ok
    saved = json.loads((folder / "config.json").read_text())
    assert {name: saved[name] for name in TINY_MLA} == {
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
    }
    assert saved["dflash_config"]["attention_mode"] == "mla" and saved["dflash_config"]["mla_rope_interleaved"]
    loaded = DSpineDraftModel.from_pretrained(folder)
    assert type(loaded.layers[0].self_attn) is DSpineMLAAttention and loaded.layers[0].self_attn.num_heads == 2
    assert tuple(loaded.layers[1].self_attn.kv_b_proj.weight.shape) == (2 * (16 + 16), 32)


def test_train_drafter_mla_sizes_from_options():
    from liger_dspine.drafter_training.setup import drafter_config

    target = tiny_target()  # a Qwen3: no MLA sizes of its own
    argv = ["--drafter-attention", "mla", "--drafter-q-lora-rank", "0", "--drafter-kv-lora-rank", "8"]
    argv += ["--drafter-qk-nope-head-dim", "4", "--drafter-qk-rope-head-dim", "6", "--drafter-v-head-dim", "10"]
    config = drafter_config(parse_train_drafter(*argv), target)
    assert config.uses_mla
    assert mla_settings(config) == MLASettings(None, 8, 4, 6, 10, rope_interleaved=True, output_gate=False)
    with pytest.raises(ValueError, match="needs --drafter-qk-rope-head-dim"):
        drafter_config(parse_train_drafter(*argv[:-4], "--drafter-v-head-dim", "10"), target)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--drafter-kv-lora-rank", "8"], "--drafter-kv-lora-rank needs --drafter-attention mla"),
        (["--drafter-attention", "mla", "--drafter-qk-rope-head-dim", "3"], "qk_rope_head_dim must be even"),
    ],
)
def test_train_drafter_mla_argument_errors(tmp_path, capsys, argv, message):
    from liger_dspine.cli import main

    assert main(["train-drafter", "--tiny", "--no-liger", "--output-dir", str(tmp_path), *argv]) == 2
    error = capsys.readouterr().err
    assert message in error, error
