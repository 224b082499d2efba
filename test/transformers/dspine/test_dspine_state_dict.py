"""DSpine checkpoint contract: SpecForge key names and shapes, strict loading, save / reload, kernel choice."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from safetensors.torch import save_file

from liger_dspine.models.dspine import DSpineDraftConfig
from liger_dspine.models.dspine import DSpineDraftModel
from tiny_dspine import QWEN3_8B_DSPINE
from tiny_dspine import tiny_draft_config
from tiny_dspine import tiny_target


def expected_shapes(H, I, n_h, n_kv, d, L, T, r, m, V):  # noqa: E741
    """dspine.md section 2.2, written out."""
    shapes = {}
    for i in range(L):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (n_h * d, H),
                p + "self_attn.k_proj.weight": (n_kv * d, H),
                p + "self_attn.v_proj.weight": (n_kv * d, H),
                p + "self_attn.o_proj.weight": (H, n_h * d),
                p + "self_attn.q_norm.weight": (d,),
                p + "self_attn.k_norm.weight": (d,),
                p + "mlp.gate_proj.weight": (I, H),
                p + "mlp.up_proj.weight": (I, H),
                p + "mlp.down_proj.weight": (H, I),
                p + "input_layernorm.weight": (H,),
                p + "post_attention_layernorm.weight": (H,),
                f"injection.readouts.{i}.weight": (r, H),
                f"injection.writes.{i}.weight": (H, m),
            }
        )
    shapes.update(
        {
            "norm.weight": (H,),
            "fc.weight": (H, T * H),
            "hidden_norm.weight": (H,),
            "injection.message.weight": (m, r),
            "injection.receiver_gate.weight": (m, r),
            "injection.predecessor_gate.weight": (m, r),
            "injection.bias": (m,),
            "transfer_codes": (V, r),
            "transfer_ready": (),
        }
    )
    return shapes


def shapes_of(model):
    return {key: tuple(value.shape) for key, value in model.state_dict().items()}


def test_tiny_state_dict_keys_and_shapes():
    model = DSpineDraftModel(tiny_draft_config())
    assert shapes_of(model) == expected_shapes(H=32, I=64, n_h=4, n_kv=2, d=8, L=2, T=2, r=8, m=4, V=96)
    assert model.state_dict()["transfer_ready"].dtype == torch.bool


def test_qwen3_8b_state_dict_keys_shapes_and_parameter_count():
    config = DSpineDraftConfig.from_dict(dict(QWEN3_8B_DSPINE))
    with torch.device("meta"):
        model = DSpineDraftModel(config)
    expected = expected_shapes(H=4096, I=12288, n_h=32, n_kv=8, d=128, L=5, T=5, r=1024, m=512, V=151936)
    assert shapes_of(model) == expected
    assert sum(p.numel() for p in model.parameters()) == 1_081_657_088
    assert model.transfer_codes.numel() == 151936 * 1024


def test_attention_bias_adds_bias_keys():
    model = DSpineDraftModel(tiny_draft_config(attention_bias=True))
    keys = set(model.state_dict())
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert f"layers.0.self_attn.{name}.bias" in keys


def test_no_rotary_keys_and_fresh_spine_init():
    model = DSpineDraftModel(tiny_draft_config())
    assert not any(key.startswith("rotary_emb") for key in model.state_dict())
    injection = model.injection
    assert all(torch.count_nonzero(write.weight) == 0 for write in injection.writes)
    assert torch.count_nonzero(injection.predecessor_gate.weight) == 0 and torch.count_nonzero(injection.bias) == 0
    # Readouts, message and receiver gate keep PyTorch's Linear init (uniform, bound 1/sqrt(fan_in)), not N(0, 0.02).
    for linear in (injection.readouts[0], injection.message, injection.receiver_gate):
        bound = 1 / linear.in_features**0.5
        assert linear.weight.abs().max() <= bound and linear.weight.abs().max() > 0.5 * bound
    assert not bool(model.transfer_ready) and torch.count_nonzero(model.transfer_codes) == 0
    assert torch.equal(model.norm.weight, torch.ones(32))


def trained_like_draft():
    torch.manual_seed(0)
    target = tiny_target()
    model = DSpineDraftModel(tiny_draft_config())
    model.initialize_transfer_space(target.lm_head.weight)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return model


def test_strict_load_of_a_specforge_style_checkpoint(tmp_path):
    """A SpecForge export: config with model_type qwen3, safetensors of draft_model.state_dict() without prefix."""
    source = trained_like_draft()
    (tmp_path / "config.json").write_text(json.dumps(source.config.to_specforge_dict()))
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, str(tmp_path / "model.safetensors"))
    loaded = DSpineDraftModel.from_pretrained(tmp_path)
    for key, value in source.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    fresh = DSpineDraftModel(tiny_draft_config())
    fresh.load_state_dict(load_file(str(tmp_path / "model.safetensors")), strict=True)
    assert bool(fresh.transfer_ready)


def test_save_and_reload_is_bit_identical(tmp_path):
    source = trained_like_draft()
    source.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert set(saved) == set(source.state_dict())
    assert saved["transfer_ready"].dtype == torch.bool and saved["transfer_ready"].dim() == 0
    loaded = DSpineDraftModel.from_pretrained(tmp_path)
    assert bool(loaded.transfer_ready)
    for key, value in source.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    hidden = torch.randn(3, 32)
    predecessors = torch.tensor([1, 2, 3])
    assert torch.equal(loaded.refine(hidden, predecessors), source.refine(hidden, predecessors))


def test_liger_choice_is_not_saved_and_reloads_native(tmp_path):
    pytest.importorskip("liger_kernel")
    source = trained_like_draft()
    liger = DSpineDraftModel(source.config, use_liger_kernel=True)
    assert type(liger.norm).__module__ == "liger_dspine.modules.rms_norm"
    assert type(liger.layers[0].self_attn.q_norm).__name__ == "LigerRMSNorm"
    assert liger.layers[0].input_layernorm.casting_mode == "llama"
    assert type(liger.layers[0].mlp).__name__ == "LigerSwiGLUMLP"
    assert set(liger.state_dict()) == set(source.state_dict())
    liger.load_state_dict(source.state_dict(), strict=True)
    liger.save_pretrained(tmp_path)
    assert "use_liger_kernel" not in json.loads((tmp_path / "config.json").read_text())
    native = DSpineDraftModel.from_pretrained(tmp_path)
    assert type(native.norm).__name__ == "Qwen3RMSNorm" and type(native.layers[1].mlp).__name__ == "Qwen3MLP"
    for key, value in source.state_dict().items():
        assert torch.equal(native.state_dict()[key], value), key
    reloaded_liger = DSpineDraftModel.from_pretrained(tmp_path, use_liger_kernel=True)
    assert type(reloaded_liger.hidden_norm).__name__ == "LigerRMSNorm"
    assert torch.equal(reloaded_liger.transfer_codes, source.transfer_codes)


def test_liger_mlp_refuses_unsupported_activation():
    pytest.importorskip("liger_kernel")
    with pytest.raises(ValueError, match="hidden_act"):
        DSpineDraftModel(tiny_draft_config(hidden_act="gelu"), use_liger_kernel=True)


NATIVE_WITHOUT_LIGER = """
import sys
sys.modules["liger_kernel"] = None  # any import of liger_kernel now fails
sys.path.insert(0, sys.argv[1])  # the test folder, for tiny_dspine
import torch
from liger_dspine.models.dspine import DSpineDraftModel, DSpineObjective
from tiny_dspine import target_batch, tiny_draft_config, tiny_target
target = tiny_target()
draft = DSpineDraftModel(tiny_draft_config())
objective = DSpineObjective(draft, target.lm_head, target.model.embed_tokens, num_anchors=3).train()
batch = target_batch(target, torch.randint(0, 95, (2, 12)))
out = objective(**batch.as_kwargs(), global_step=100, total_steps=600)
out.loss.backward()
assert torch.isfinite(out.loss)
assert not any(name.startswith("liger_kernel") for name in sys.modules if sys.modules[name] is not None)
print("ok", float(out.loss))
"""


def test_native_model_never_imports_liger_kernel():
    env = dict(os.environ)
    env.pop("LIGER_DSPINE_INTERPRET", None)
    test_dir = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", NATIVE_WITHOUT_LIGER, str(test_dir)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("ok")


def test_a_specforge_qwen3_config_object_builds_the_drafter():
    from transformers import Qwen3Config

    specforge = tiny_draft_config().to_specforge_dict()
    specforge.pop("model_type")
    model = DSpineDraftModel(Qwen3Config(**specforge))
    assert isinstance(model.config, DSpineDraftConfig) and model.block_size == 4
    assert shapes_of(model) == expected_shapes(H=32, I=64, n_h=4, n_kv=2, d=8, L=2, T=2, r=8, m=4, V=96)
    with pytest.raises(ValueError, match="DSpine draft config"):
        DSpineDraftModel(Qwen3Config(hidden_size=32, num_attention_heads=4, head_dim=8, vocab_size=96))


def test_builders_module_globals_choose_the_native_classes(monkeypatch):
    """A class-level patch of builders.Qwen3RMSNorm / builders.Qwen3MLP reaches every RMSNorm and MLP built after it."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from liger_dspine.models.dspine import builders

    class MarkedRMSNorm(Qwen3RMSNorm):
        pass

    class MarkedMLP(Qwen3MLP):
        pass

    monkeypatch.setattr(builders, "Qwen3RMSNorm", MarkedRMSNorm)
    monkeypatch.setattr(builders, "Qwen3MLP", MarkedMLP)
    model = DSpineDraftModel(tiny_draft_config())
    norms = [name for name, module in model.named_modules() if isinstance(module, Qwen3RMSNorm)]
    assert all(isinstance(module, MarkedRMSNorm) for module in model.modules() if isinstance(module, Qwen3RMSNorm))
    assert len(norms) == 2 * 4 + 2  # per layer: input, post-attention, q, k; plus norm and hidden_norm
    assert all(isinstance(layer.mlp, MarkedMLP) for layer in model.layers)
