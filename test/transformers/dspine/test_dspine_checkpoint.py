"""DSpine checkpoints in SpecForge's layout: what save_pretrained writes, loading by architecture, check and convert."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3Config

from liger_dspine import AutoLigerDSpineForCausalLM
from liger_dspine import revert_liger_kernel_to_dspine
from liger_dspine.cli import main as cli_main
from liger_dspine.models.dspine import DSpineDraftModel
from liger_dspine.models.dspine.checkpoint import check_checkpoint
from liger_dspine.models.dspine.checkpoint import convert_checkpoint
from liger_dspine.registry import model_type_for_config
from tiny_dspine import tiny_draft_config

DSPINE_FIELDS = {
    "transfer_rank", "message_size", "top_k", "ce_weight", "alignment_weight", "alignment_warmup_steps",
    "replacement_layers", "replacement_probability", "replacement_hold_ratio", "replacement_end_ratio",
    "candidate_mass_threshold",
}  # fmt: skip


def trained_draft(seed=0):
    torch.manual_seed(seed)
    model = DSpineDraftModel(tiny_draft_config())
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
        model.transfer_codes.normal_()
        model.transfer_ready.fill_(True)
    return model


def config_of(model) -> dict:
    return {key: value for key, value in model.config.to_dict().items() if key != "_name_or_path"}


def assert_same_weights(a, b):
    assert list(a.state_dict()) == list(b.state_dict())
    for key, value in a.state_dict().items():
        assert torch.equal(b.state_dict()[key], value), key


@pytest.fixture
def saved(tmp_path):
    model = trained_draft()
    model.save_pretrained(tmp_path / "specforge")
    return model, tmp_path / "specforge"


def legacy_folder(saved_folder, tmp_path):
    """The same checkpoint in this package's older layout: model_type "dspine", no auto_map."""
    folder = tmp_path / "legacy"
    folder.mkdir()
    config = json.loads((saved_folder / "config.json").read_text())
    config["model_type"] = "dspine"
    config.pop("auto_map")
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes((saved_folder / "model.safetensors").read_bytes())
    return folder


def test_save_pretrained_writes_specforge_layout(saved):
    model, folder = saved
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    assert config["architectures"] == ["DSpineDraftModel"]
    assert config["auto_map"] == {"AutoModel": "dspine.DSpineDraftModel"}
    assert config["dflash_config"] == {"mask_token_id": 95, "target_layer_ids": [0, 2]}
    assert set(config["dspine_config"]) == DSPINE_FIELDS and config["dspine_config"]["transfer_rank"] == 8
    assert config["block_size"] == 4 and config["hidden_size"] == 32 and config["num_hidden_layers"] == 2
    assert Qwen3Config.from_dict(config).architectures == ["DSpineDraftModel"]  # what SpecForge's reader builds
    assert set(load_file(str(folder / "model.safetensors"))) == set(model.state_dict())


def test_load_save_load_is_identical(saved, tmp_path):
    model, folder = saved
    loaded = DSpineDraftModel.from_pretrained(folder)
    assert loaded.config.model_type == "dspine" and config_of(loaded) == config_of(model)
    assert_same_weights(model, loaded)
    loaded.save_pretrained(tmp_path / "again")
    assert (tmp_path / "again" / "config.json").read_text() == (folder / "config.json").read_text()
    again = DSpineDraftModel.from_pretrained(tmp_path / "again")
    assert config_of(again) == config_of(model)
    assert_same_weights(model, again)


def test_a_drafter_is_recognised_before_its_model_type(saved, tmp_path):
    _, folder = saved
    specforge = Qwen3Config.from_dict(json.loads((folder / "config.json").read_text()))
    assert model_type_for_config(specforge) == "dspine"
    marked_by_options = Qwen3Config(hidden_size=32, dspine_config={})
    assert model_type_for_config(marked_by_options) == "dspine"
    assert model_type_for_config(Qwen3Config(hidden_size=32)) == "qwen3"
    assert model_type_for_config(tiny_draft_config()) == "dspine"


@pytest.mark.parametrize("layout", ["specforge", "legacy"])
def test_auto_liger_loads_a_drafter(saved, tmp_path, layout):
    model, folder = saved
    folder = folder if layout == "specforge" else legacy_folder(folder, tmp_path)
    try:
        loaded = AutoLigerDSpineForCausalLM.from_pretrained(folder)
        assert type(loaded) is DSpineDraftModel
        assert type(loaded.norm).__name__ == "LigerRMSNorm"  # the dspine patch, applied at class level
        assert_same_weights(model, loaded)
    finally:
        revert_liger_kernel_to_dspine()
    assert_same_weights(model, DSpineDraftModel.from_pretrained(folder))


def test_a_plain_qwen3_stays_a_qwen3(tmp_path):
    Qwen3Config(hidden_size=32, num_attention_heads=4, head_dim=8, vocab_size=96).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no patch for model type 'qwen3'"):
        AutoLigerDSpineForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not a DSpine draft config"):
        DSpineDraftModel.from_pretrained(tmp_path)


# ---------------------------------------------------------------------------------------------- check and convert
def test_check_a_good_and_a_legacy_checkpoint(saved, tmp_path):
    _, folder = saved
    report = check_checkpoint(folder)
    assert report.ok and report.layout.startswith("SpecForge")
    assert "weights: 35 tensors, 35 expected" in str(report) and "OK:" in str(report)
    legacy = check_checkpoint(legacy_folder(folder, tmp_path))
    assert not legacy.ok and legacy.layout.startswith("older liger-dspine")
    assert legacy.problems == ['model_type "dspine" is not SpecForge\'s layout (SpecForge needs "qwen3")']


def test_check_reports_keys_shapes_and_config(saved, tmp_path):
    from safetensors.torch import save_file

    _, folder = saved
    weights = load_file(str(folder / "model.safetensors"))
    del weights["injection.bias"]
    weights["fc.weight"] = torch.zeros(32, 96)
    weights["lm_head.weight"] = torch.zeros(96, 32)
    save_file(weights, str(folder / "model.safetensors"))
    report = check_checkpoint(folder)
    assert report.problems == [
        "missing key injection.bias [4]",
        "unexpected key lm_head.weight [96, 32]",
        "key fc.weight has shape [32, 96], the config needs [32, 64]",
    ]
    config = json.loads((folder / "config.json").read_text())
    config["dspine_config"]["top_k"] = 0
    (folder / "config.json").write_text(json.dumps(config))
    assert check_checkpoint(folder).problems == [
        "config does not validate: DSpine top_k must be in [1, vocab_size=96], got 0"
    ]


def test_convert_a_legacy_folder(saved, tmp_path):
    model, folder = saved
    legacy = legacy_folder(folder, tmp_path)
    report = convert_checkpoint(legacy, tmp_path / "converted")
    assert report.ok, str(report)
    converted = json.loads((tmp_path / "converted" / "config.json").read_text())
    assert converted == json.loads((folder / "config.json").read_text())
    assert (tmp_path / "converted" / "model.safetensors").read_bytes() == (legacy / "model.safetensors").read_bytes()
    assert_same_weights(model, DSpineDraftModel.from_pretrained(tmp_path / "converted"))
    with pytest.raises(ValueError, match=r"^liger-dspine: .* exists and is not empty"):
        convert_checkpoint(legacy, tmp_path / "converted")


def test_convert_command(saved, tmp_path, capsys):
    _, folder = saved
    legacy = legacy_folder(folder, tmp_path)
    assert cli_main(["convert", "--check", str(legacy)]) == 1
    assert "1 problem(s)" in capsys.readouterr().out
    assert cli_main(["convert", str(legacy), str(tmp_path / "out")]) == 0
    assert "OK: config, keys and shapes match the drafter" in capsys.readouterr().out
    assert cli_main(["convert", str(legacy), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.startswith("liger-dspine: ")
    assert cli_main(["convert", str(tmp_path / "nowhere"), "--check"]) == 2
    assert "has no config.json" in capsys.readouterr().err
