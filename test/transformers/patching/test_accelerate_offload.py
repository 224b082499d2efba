"""A class-level-patched model whose weights accelerate offloads (what ``from_pretrained(device_map="auto")`` does
when the model does not fit): every module's weights wait on disk until its own call, so a fused path that reads a
child's weights without calling it must run the module natively instead. The logits equal the native model's."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tiny_family import CASES  # noqa: E402


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_disk_offloaded_patched_model_computes_the_native_logits(model_type, tmp_path):
    from accelerate import disk_offload

    case = CASES[model_type]
    native = case.build()
    input_ids = torch.randint(0, case.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = native(input_ids).logits
    case.apply_fn()()
    try:
        patched = case.build()
        patched.load_state_dict(native.state_dict())
        assert any(type(module).__name__.startswith("Liger") for module in patched.modules())
        patched = disk_offload(patched, str(tmp_path), execution_device="cpu")
        assert all(p.device.type == "meta" for p in patched.parameters())  # loaded at each module's call only
        with torch.no_grad():
            logits = patched(input_ids).logits
    finally:
        case.revert_fn()()
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_deepseek_v4_layer_with_offloaded_hyper_connections_runs_natively_and_says_so(caplog):
    case = CASES["deepseek_v4"]
    case.modeling_or_skip()
    from liger_dspine import patching

    model = case.build()
    case.apply_fn()(model=model)
    layer = case.decoder_of(model).layers[0]
    hidden = torch.randn(2, 5, model.config.hc_mult, model.config.hidden_size)
    assert layer._liger_applies(hidden)
    layer.ffn_hc.register_forward_pre_hook(lambda module, args: None)
    patching._WARNED_KEPT_NATIVE.clear()
    with caplog.at_level("WARNING", logger="liger_dspine.patching"):
        assert not layer._liger_applies(hidden)
    assert "ffn_hc carry a forward or hooks of their own" in caplog.text
