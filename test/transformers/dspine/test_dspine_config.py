"""DSpine configuration: validation, schedules, default taps, and loading DSpine / SpecForge / Qwen3 files."""

import json
import math

import pytest
from transformers import Qwen3Config

from liger_dspine.models.dspine.configuration import DSpineConfig
from liger_dspine.models.dspine.configuration import DSpineDraftConfig
from liger_dspine.models.dspine.configuration import build_target_layer_ids
from tiny_dspine import QWEN3_8B_DSPINE
from tiny_dspine import tiny_draft_config


@pytest.mark.parametrize(
    "options, field",
    [
        ({"transfer_rank": 17}, "transfer_rank"),
        ({"top_k": 0}, "top_k"),
        ({"message_size": 0}, "message_size"),
        ({"alignment_weight": math.nan}, "alignment_weight"),
        ({"replacement_hold_ratio": 0.5}, "replacement_hold_ratio"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"top_k": 33}, "top_k"),
        ({"ce_weight": 1.5}, "ce_weight"),
        ({"alignment_weight": -0.1}, "alignment_weight"),
        ({"alignment_warmup_steps": -1}, "alignment_warmup_steps"),
        ({"replacement_layers": -1}, "replacement_layers"),
        ({"replacement_probability": 1.5}, "replacement_probability"),
        ({"replacement_end_ratio": 1.5}, "replacement_end_ratio"),
        ({"candidate_mass_threshold": 1.0}, "candidate_mass_threshold"),
        ({"candidate_mass_threshold": math.inf}, "candidate_mass_threshold"),
        ({"not_an_option": 1}, "not_an_option"),
    ],
)
def test_invalid_options_raise_value_error_naming_the_field(options, field):
    # Tiny H=16, V=32 as in SpecForge's validation tests: transfer_rank must be <= min(16, 31).
    base = {"transfer_rank": 8, "message_size": 4, "top_k": 3}
    with pytest.raises(ValueError, match=field) as error:
        tiny_draft_config(
            hidden_size=16,
            vocab_size=32,
            head_dim=4,
            dflash_config={"target_layer_ids": [1]},
            dspine_config={**base, **options},
        )
    assert str(error.value).startswith("DSpine")


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"block_size": 1}, "block_size"),
        ({"block_size": True}, "block_size"),
        ({"block_size": 4.0}, "block_size"),
        ({"is_causal": False}, "causal"),
        ({"is_causal": "yes"}, "is_causal"),
        ({"dflash_config": {"mask_token_id": 96, "target_layer_ids": [0]}}, "mask_token_id"),
        ({"dflash_config": {"target_layer_ids": []}}, "target_layer_ids"),
        ({"dflash_config": {}}, "target_layer_ids"),
        ({"num_target_layers": 4.5, "dflash_config": {}}, "num_target_layers"),
        ({"layer_types": ["full_attention"]}, "layer_types"),
        ({"layer_types": ["full_attention", "chunked_attention"]}, "layer_types"),
    ],
)
def test_invalid_draft_fields_raise_value_error(overrides, field):
    with pytest.raises(ValueError, match=field):
        tiny_draft_config(**overrides)


def test_block_size_falls_back_to_dflash_config():
    config = tiny_draft_config(block_size=None, dflash_config={"block_size": 6, "target_layer_ids": [0]})
    assert config.block_size == 6


def test_schedule_endpoints():
    options = DSpineConfig()
    assert options.schedule(0, 600) == (0.0, 0.5)
    assert options.schedule(100, 600)[1] == 0.5
    assert options.schedule(150, 600)[1] == pytest.approx(0.25, abs=1e-12)
    assert options.schedule(200, 600)[1] == 0.0
    assert options.schedule(599, 600)[1] == 0.0
    assert options.schedule(146, 600)[0] == 0.5
    assert options.schedule(73, 600)[0] == pytest.approx(0.25, abs=1e-12)
    assert options.schedule(10_000, 600)[0] == 0.5
    assert options.schedule(-5, 600) == (0.0, 0.5)
    assert options.schedule(100, None)[1] == 0.0
    assert options.schedule(100, 0)[1] == 0.0
    assert DSpineConfig(alignment_warmup_steps=0).schedule(0, None)[0] == 0.5


def test_default_target_layer_ids():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(36, 1) == [18]
    # Banker's rounding: 1 + 1 * 5 / 2 = 3.5 -> 4, 1 + 2 * 5 / 2 = 6.
    assert build_target_layer_ids(9, 3) == [1, 4, 6]
    config = tiny_draft_config(num_target_layers=36, num_hidden_layers=5, dflash_config={"mask_token_id": 3})
    assert config.target_layer_ids == [1, 9, 17, 25, 33]


def test_specforge_qwen3_8b_config_loads(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B_DSPINE))
    config = DSpineDraftConfig.from_pretrained(tmp_path)
    assert config.model_type == "dspine"
    assert config.block_size == 16
    assert config.target_layer_ids == [1, 9, 17, 25, 33]
    assert config.mask_token_id == 151669
    assert config.dspine_options == DSpineConfig()
    assert config.rope_parameters["rope_theta"] == 1000000
    assert config.head_dim == 128 and config.num_key_value_heads == 8


def test_saved_config_lists_every_option_and_round_trips(tmp_path):
    config = tiny_draft_config(dspine_config={"transfer_rank": 8, "message_size": 4, "top_k": 3, "ce_weight": 0.25})
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "qwen3" and saved["auto_map"] == {"AutoModel": "dspine.DSpineDraftModel"}
    assert saved["architectures"] == ["DSpineDraftModel"]
    assert sorted(saved["dspine_config"]) == sorted(DSpineConfig().to_dict())
    assert saved["dspine_config"]["ce_weight"] == 0.25
    reloaded = DSpineDraftConfig.from_pretrained(tmp_path)
    assert reloaded.to_dict() == config.to_dict()


def test_specforge_form_round_trips(tmp_path):
    config = tiny_draft_config()
    specforge = config.to_specforge_dict()
    assert specforge["model_type"] == "qwen3" and specforge["architectures"] == ["DSpineDraftModel"]
    (tmp_path / "config.json").write_text(json.dumps(specforge))
    reloaded = DSpineDraftConfig.from_pretrained(tmp_path)
    assert reloaded.dspine_config == config.dspine_config
    assert reloaded.dflash_config == config.dflash_config


def test_qwen3_config_marked_by_architectures_alone_loads(tmp_path):
    # Without dspine_config every option takes its default (transfer_rank 1024 needs H >= 1024).
    config_dict = Qwen3Config(hidden_size=1024, num_attention_heads=8, head_dim=128, vocab_size=2048).to_dict()
    config_dict.update(architectures=["DSpineDraftModel"], block_size=4, dflash_config={"target_layer_ids": [0]})
    (tmp_path / "config.json").write_text(json.dumps(config_dict))
    config = DSpineDraftConfig.from_pretrained(tmp_path)
    assert config.dspine_options == DSpineConfig()


def test_qwen3_config_marked_by_dspine_config_alone_loads(tmp_path):
    config_dict = Qwen3Config(hidden_size=32, num_attention_heads=4, head_dim=8, vocab_size=96).to_dict()
    config_dict.update(block_size=4, dflash_config={"target_layer_ids": [0]}, dspine_config={"transfer_rank": 8})
    (tmp_path / "config.json").write_text(json.dumps(config_dict))
    config = DSpineDraftConfig.from_pretrained(tmp_path)
    assert config.dspine_options.transfer_rank == 8 and config.architectures == ["DSpineDraftModel"]


def test_plain_qwen3_config_is_not_a_drafter(tmp_path):
    Qwen3Config(hidden_size=32, num_attention_heads=4, head_dim=8, vocab_size=96).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not a DSpine draft config"):
        DSpineDraftConfig.from_pretrained(tmp_path)
    other = Qwen3Config(hidden_size=32, num_attention_heads=4, head_dim=8).to_dict()
    other.update(model_type="llama", architectures=["DSpineDraftModel"])
    with pytest.raises(ValueError, match="not a DSpine draft config"):
        DSpineDraftConfig.from_dict(other)


@pytest.mark.parametrize(
    "overrides, named",
    [
        ({"dflash_config": {"target_layer_ids": [0], "attention_mode": "mla"}}, "'mla' needs kv_lora_rank"),
        ({"dflash_config": {"target_layer_ids": [0], "attention_mode": "kda"}}, "'kda'"),
        ({"dflash_config": {"target_layer_ids": [0], "attention_mode": "sparse"}}, "'sparse'"),
        ({"dflash_config": {"target_layer_ids": [0], "attention_modes": ["gqa", "mla"]}}, "'mla' cannot be mixed"),
        ({"attention_mode": "mla"}, "'mla' cannot be mixed"),
        ({"dflash_config": {"target_layer_ids": [0], "attention_mode": "gqa", "attention_modes": ["gqa"] * 2}}, "both"),
        ({"dflash_config": {"target_layer_ids": [0], "attention_mode": "mha"}}, "num_key_value_heads"),
        ({"dflash_config": {"target_layer_ids": [0], "projector_type": "dspark"}}, "projector_type 'dspark'"),
    ],
)
def test_specforge_options_the_drafter_does_not_build_are_refused(overrides, named):
    # tiny: 4 heads, 2 KV heads, so "mha" (which needs as many KV heads as heads) is refused too
    with pytest.raises(ValueError, match=named) as error:
        tiny_draft_config(**overrides)
    assert str(error.value).startswith("DSpine")


@pytest.mark.parametrize("mode", ["gqa", "mha", "GQA"])
def test_specforge_config_with_a_supported_attention_mode_loads(tmp_path, mode):
    config_dict = json.loads(json.dumps(QWEN3_8B_DSPINE))
    config_dict["dflash_config"].update(attention_mode=mode, projector_type=None)
    if mode == "mha":
        config_dict["num_key_value_heads"] = config_dict["num_attention_heads"]
    (tmp_path / "config.json").write_text(json.dumps(config_dict))
    config = DSpineDraftConfig.from_pretrained(tmp_path)
    assert config.dflash_config["attention_mode"] == mode
    assert config.use_sliding_window is False and config.layer_types == ["full_attention"] * 5
    assert config.num_key_value_heads == (32 if mode == "mha" else 8)


def test_mha_drafter_has_as_many_key_value_heads_as_heads():
    from liger_dspine.models.dspine.modeling import DSpineDraftModel

    config = tiny_draft_config(
        num_key_value_heads=4, dflash_config={"target_layer_ids": [0, 1], "attention_modes": ["mha", "mha"]}
    )
    attention = DSpineDraftModel(config).layers[0].self_attn
    assert attention.k_proj.weight.shape == (4 * 8, 32) and attention.num_key_value_groups == 1
