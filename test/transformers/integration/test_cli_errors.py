"""The command line on bad input: one line on stderr starting with ``liger-dspine:`` that names the problem (and the
file), exit status 2 (1 for a checkpoint ``convert --check`` reads but finds wrong); argparse's own error for a bad
``demo --steps``. And ``inspect`` of a DSpine drafter, by model type or by its checkpoint folder."""

import json

import pytest
import torch

from liger_dspine.cli import main
from liger_dspine.models.dspine import DSpineDraftModel
from tiny_dspine import tiny_draft_config

USAGE = "inspect takes a model type such as deepseek_v3, a config.json or a checkpoint folder"


def one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("liger-dspine: ") and captured.err.count("\n") == 1, captured.err
    return captured.err.rstrip("\n")


@pytest.fixture
def drafter_folder(tmp_path):
    torch.manual_seed(0)
    folder = tmp_path / "drafter"
    DSpineDraftModel(tiny_draft_config()).save_pretrained(folder)
    return folder


# ------------------------------------------------------------------------------------------------- convert --check
def test_check_names_a_truncated_weights_file(drafter_folder, capsys):
    weights = drafter_folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert main(["convert", "--check", str(drafter_folder)]) == 1
    out = capsys.readouterr().out
    assert f"    - {weights} is not a readable safetensors file (truncated or damaged?): " in out
    assert "1 problem(s):" in out


def test_check_names_a_shard_the_index_names_but_the_folder_lacks(drafter_folder, capsys):
    shard = "model-00001-of-00002.safetensors"
    (drafter_folder / "model.safetensors").rename(drafter_folder / shard)
    index = drafter_folder / "model.safetensors.index.json"
    weight_map = {"fc.weight": shard, "norm.weight": "model-00002-of-00002.safetensors"}
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert main(["convert", "--check", str(drafter_folder)]) == 1
    problems = [line for line in capsys.readouterr().out.splitlines() if line.startswith("    - ")]
    assert problems == [f"    - {index} names shards that {drafter_folder} lacks: model-00002-of-00002.safetensors"]


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"model_type": ', "is not valid JSON (Expecting value: line 1 column 16 (char 15))"),
        ("[1, 2]", "must hold a JSON object, it holds an array"),
    ],
    ids=["not_json", "json_list"],
)
@pytest.mark.parametrize("check", [True, False], ids=["check", "convert"])
def test_a_config_that_is_not_a_json_object_is_named(drafter_folder, tmp_path, capsys, text, message, check):
    config = drafter_folder / "config.json"
    config.write_text(text)
    argv = ["convert", "--check", str(drafter_folder)] if check else ["convert", str(drafter_folder), str(tmp_path)]
    assert main(argv) == 2
    assert one_line_error(capsys) == f"liger-dspine: {config} {message}"


# ---------------------------------------------------------------------------------------------------------- inspect
def test_inspect_a_mistyped_model_type_names_the_closest_supported(capsys):
    assert main(["inspect", "deepseek_v33"]) == 2
    error = one_line_error(capsys)
    prefix = "liger-dspine: unknown model type 'deepseek_v33' (and no file or folder of that name); closest supported: "
    assert error.startswith(prefix)
    closest = error.removeprefix(prefix).split(", ")
    assert closest[0] == "deepseek_v3" and "deepseek_v32" in closest and len(closest) <= 3


def test_inspect_a_transformers_model_type_without_a_patch(capsys):
    assert main(["inspect", "llama"]) == 2
    error = one_line_error(capsys)
    assert error.startswith("liger-dspine: no patch for model type 'llama'; supported: ")
    assert {"deepseek_v3", "dspine"} <= set(error.split("supported: ")[1].split(", "))


def test_inspect_a_path_that_does_not_exist(tmp_path, capsys):
    missing = tmp_path / "nowhere"
    assert main(["inspect", str(missing)]) == 2
    assert one_line_error(capsys) == f"liger-dspine: {missing} does not exist; {USAGE}"


def test_inspect_an_empty_folder_and_one_without_config(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 2
    assert one_line_error(capsys) == f"liger-dspine: {tmp_path} is an empty folder; {USAGE}"
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert main(["inspect", str(tmp_path)]) == 2
    assert one_line_error(capsys) == f"liger-dspine: {tmp_path} has no config.json; {USAGE}"


def test_inspect_a_config_with_a_bad_model_type(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"hidden_size": 8}))
    assert main(["inspect", str(config)]) == 2
    assert one_line_error(capsys) == f"liger-dspine: {config} names no model_type (got None); {USAGE}"
    config.write_text(json.dumps({"model_type": "deepseekv3"}))
    assert main(["inspect", str(tmp_path)]) == 2
    error = one_line_error(capsys)
    assert error.startswith(f"liger-dspine: {config} has model_type 'deepseekv3', which transformers does not know; ")
    assert "closest supported: deepseek_v3" in error


def dspine_swaps(out: str) -> dict[str, str]:
    """'<target>' -> '<count>' of each swap line of the report (the objective's line left out)."""
    lines = out.splitlines()
    start = lines.index("liger-dspine patch for dspine (instance level):")
    swaps = [line for line in lines[start + 1 :] if line != OBJECTIVE_LINE]
    return {line.split(" x")[0].strip(): line.split(" x")[1].split(":")[0] for line in swaps}


OBJECTIVE_LINE = (
    "  and on a DSpineObjective over the drafter: DSpineObjective.patched_fused_objective -> "
    "liger_dspine.models.dspine.fused_switch.fused_objective_on"
)


def test_inspect_dspine_builds_a_drafter_of_qwen3_sizes(capsys):
    assert main(["inspect", "dspine"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == (
        "(a DSpine drafter has no default config; taken to build one: Qwen3's default sizes, num_hidden_layers=5, "
        "block_size=16, num_target_layers=36)"
    )
    # 5 layers: 4 norms each (input, post-attention, q, k) + hidden_norm + the final norm
    assert dspine_swaps(out) == {
        "Qwen3RMSNorm modules": "22",
        "Qwen3MLP modules": "5",
        "DSpineAttention modules": "5",
        "AdjacentInjection modules": "1",
    }
    assert out.splitlines()[-1] == OBJECTIVE_LINE


@pytest.mark.parametrize("layout", ["specforge", "legacy"])
def test_inspect_a_drafter_checkpoint_folder(drafter_folder, capsys, layout):
    if layout == "legacy":  # the older model_type "dspine" layout
        config = json.loads((drafter_folder / "config.json").read_text())
        config["model_type"] = "dspine"
        (drafter_folder / "config.json").write_text(json.dumps(config))
    assert main(["inspect", str(drafter_folder)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "liger-dspine patch for dspine (instance level):"
    assert dspine_swaps(out) == {
        "Qwen3RMSNorm modules": "10",
        "Qwen3MLP modules": "2",
        "DSpineAttention modules": "2",
        "AdjacentInjection modules": "1",
    }
    assert out.splitlines()[-1] == OBJECTIVE_LINE


# ------------------------------------------------------------------------------------------------------------- demo
@pytest.mark.parametrize("steps", ["0", "-3"])
def test_demo_refuses_steps_below_one(capsys, steps):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--steps", steps])
    assert exit_info.value.code == 2
    assert f"liger-dspine demo: error: argument --steps: must be a positive integer, got {int(steps)}" in (
        capsys.readouterr().err
    )
