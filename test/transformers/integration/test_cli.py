"""``liger-dspine inspect``: the report of what the patch replaces, for a config on disk or a model type."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from liger_dspine.cli import main  # noqa: E402
from tiny_models import native_experts_class
from tiny_models import tiny_deepseek_v3_config  # noqa: E402


def test_inspect_a_saved_config_lists_every_swap(tmp_path, capsys):
    tiny_deepseek_v3_config().save_pretrained(tmp_path)

    assert main(["inspect", str(tmp_path / "config.json")]) == 0

    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "liger-dspine patch for deepseek_v3 (instance level):"
    counts = {line.split(":")[0].strip() for line in lines[1:]}
    # 2 layers: 4 norms each (input, post-attention, q_a, kv_a) + the final norm; 1 dense MLP + 1 shared expert;
    # 2 attention modules; 1 router; 1 routed experts module; the causal LM's forward
    assert counts == {
        f"{native_experts_class().__name__} modules x1",
        "DeepseekV3RMSNorm modules x9",
        "DeepseekV3MLP modules x2",
        "DeepseekV3Attention modules x2",
        "DeepseekV3TopkRouter modules x1",
        "DeepseekV3ForCausalLM.forward of the instance x1",
    }


def test_inspect_a_model_type(capsys):
    assert main(["inspect", "deepseek_v3"]) == 0
    out = capsys.readouterr().out
    # transformers' default DeepSeek-V3 config: 61 layers, the first 3 dense
    assert "DeepseekV3Attention modules x61" in out
    assert "DeepseekV3TopkRouter modules x58" in out
