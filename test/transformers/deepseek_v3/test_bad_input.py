"""Bad input to the DeepSeek-V3 patch: each case fails early with a clear error, or has a defined result.

Label errors are raised before the decoder runs (checked with a forward pre-hook on ``model.model``), so no
kernel sees them. Every-label-ignored batches give a loss of 0 and zero gradients (transformers gives NaN).
fp32 on the CPU interpreter; the decoder is native where only the loss path matters (fast).
"""

import copy
import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch

from liger_dspine import apply_liger_kernel_to_deepseek_v3
from liger_dspine import apply_liger_kernel_to_instance
from liger_dspine._versions import SUPPORTED
from tiny_models import IGNORE_INDEX
from tiny_models import build_model
from tiny_models import changed_modeling_globals
from tiny_models import grads_of
from tiny_models import modeling_module
from tiny_models import module_types
from tiny_models import random_batch
from tiny_models import snapshot_modeling_globals
from tiny_models import tiny_deepseek_v3_config

pytestmark = pytest.mark.matrix  # runs against every transformers version of the matrix

VOCAB = 96  # tiny_deepseek_v3_config's vocab_size
ONLY_LOSS_FORWARD = dict(rope=False, rms_norm=False, swiglu=False, moe_router=False)
LOSS_FORWARDS = {
    "lce": {},
    "ce": dict(cross_entropy=True, fused_linear_cross_entropy=False),
}


@pytest.fixture(scope="module")
def native_model():
    return build_model(tiny_deepseek_v3_config())


def patched(native_model, variant: str, **options):
    model = copy.deepcopy(native_model)
    apply_liger_kernel_to_deepseek_v3(model=model, **LOSS_FORWARDS[variant], **options)
    return model


@pytest.fixture(scope="module")
def batch():
    return random_batch(tiny_deepseek_v3_config(), batch=2, seq=6)


def count_decoder_calls(model) -> list:
    calls = []
    model.model.register_forward_pre_hook(lambda module, args: calls.append(1))
    return calls


# ------------------------------------------------------------------------------------------- labels out of range
BAD_LABELS = {
    # name: (position -> value, message fragment naming the bad values)
    "vocab_size": ({(0, 2): VOCAB}, f"from {VOCAB} to {VOCAB}"),
    "far_above": ({(0, 2): VOCAB + 5, (1, 4): 1000}, f"2 label(s) are outside, with values from {VOCAB + 5} to 1000"),
    "minus_one": ({(1, 3): -1}, "from -1 to -1"),
    "other_negative": ({(1, 1): -7, (0, 5): -200}, "from -200 to -7"),
}
PATHS = {
    # name: (loss forward, training, extra forward arguments)
    "lce_fused": ("lce", True, {}),
    "lce_logits_eval": ("lce", False, {}),
    "lce_logits_skip_false": ("lce", True, {"skip_logits": False}),
    "lce_fused_eval": ("lce", False, {"skip_logits": True}),
    "ce": ("ce", True, {}),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bad", BAD_LABELS)
@pytest.mark.parametrize("as_shift_labels", [False, True], ids=["labels", "shift_labels"])
def test_labels_outside_the_vocabulary_fail_before_the_decoder(native_model, batch, path, bad, as_shift_labels):
    variant, training, extra = PATHS[path]
    model = patched(native_model, variant).train(training)
    calls = count_decoder_calls(model)
    input_ids, labels = batch
    values, fragment = BAD_LABELS[bad]
    labels = labels.clone()
    labels[:, 0] = IGNORE_INDEX  # -100 stays valid anywhere
    for position, value in values.items():
        labels[position] = value
    target = {"shift_labels": labels} if as_shift_labels else {"labels": labels}

    with pytest.raises(ValueError, match=rf"labels must be in \[0, {VOCAB}\).*-100") as raised:
        model(input_ids, **target, **extra)

    assert fragment in str(raised.value)
    assert calls == []


def test_the_last_valid_label_is_accepted(native_model, batch):
    model = patched(native_model, "lce", **ONLY_LOSS_FORWARD).train()
    input_ids, labels = batch
    labels = labels.clone()
    labels[0, 3], labels[1, 2] = VOCAB - 1, 0

    loss = model(input_ids, labels=labels).loss

    with torch.no_grad():
        expected = native_model(input_ids, labels=labels).loss
    torch.testing.assert_close(loss.detach(), expected, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------ every label ignored
ALL_IGNORED = {
    # name: (loss forward, training, extra forward arguments, num_items_in_batch)
    "lce_fused": ("lce", True, {}, None),
    "lce_fused_num_items_0": ("lce", True, {}, torch.tensor(0)),
    "lce_fused_num_items_int_0": ("lce", True, {}, 0),
    "lce_fused_num_items_5": ("lce", True, {}, torch.tensor(5)),
    "lce_logits_eval": ("lce", False, {}, None),
    "lce_logits_num_items_0": ("lce", True, {"skip_logits": False}, torch.tensor(0)),
    "ce": ("ce", True, {}, None),
    "ce_num_items_0": ("ce", True, {}, torch.tensor(0)),
}


@pytest.mark.parametrize("case", ALL_IGNORED)
def test_every_label_ignored_gives_zero_loss_and_zero_gradients(native_model, batch, case):
    variant, training, extra, num_items = ALL_IGNORED[case]
    model = patched(native_model, variant, **ONLY_LOSS_FORWARD).train(training)
    input_ids, labels = batch
    ignored = torch.full_like(labels, IGNORE_INDEX)
    if num_items is not None:
        extra = {**extra, "num_items_in_batch": num_items}

    model.zero_grad(set_to_none=True)
    out = model(input_ids, labels=ignored, **extra)
    out.loss.backward()

    assert out.loss.item() == 0.0
    grads = grads_of(model)
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads.values())
    if out.logits is None:  # the fused path: no token to score
        assert torch.isnan(out.token_accuracy)


@pytest.mark.parametrize("num_items", [None, torch.tensor(0)], ids=["mean", "num_items_0"])
def test_native_forward_gives_nan_when_every_label_is_ignored(native_model, batch, num_items):
    """The deliberate difference documented in ``lce_forward``: transformers returns NaN here."""
    input_ids, labels = batch
    extra = {} if num_items is None else {"num_items_in_batch": num_items}
    with torch.no_grad():
        loss = native_model.train()(input_ids, labels=torch.full_like(labels, IGNORE_INDEX), **extra).loss
    assert torch.isnan(loss)


def test_ignored_rows_do_not_change_the_loss_of_the_others(native_model, batch):
    """A fully ignored sample beside a labelled one: the loss is the labelled sample's mean, as in transformers."""
    model = patched(native_model, "lce", **ONLY_LOSS_FORWARD).train()
    input_ids, labels = batch
    labels = labels.clone()
    labels[1] = IGNORE_INDEX

    loss = model(input_ids, labels=labels).loss

    with torch.no_grad():
        expected = native_model(input_ids[:1], labels=labels[:1]).loss
    torch.testing.assert_close(loss.detach(), expected, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------ other forward misuse
def test_shift_labels_of_the_wrong_shape_fail_before_the_loss(native_model, batch):
    model = patched(native_model, "lce", **ONLY_LOSS_FORWARD).train()
    input_ids, labels = batch
    with pytest.raises(ValueError, match=r"labels of shape \(2, 5\) do not match the hidden states \(2, 6\)"):
        model(input_ids, shift_labels=labels[:, 1:])


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_skip_logits_without_labels_fails_before_the_decoder(native_model, batch, training):
    model = patched(native_model, "lce").train(training)
    calls = count_decoder_calls(model)
    with pytest.raises(ValueError, match="skip_logits=True needs labels or shift_labels"):
        model(batch[0], skip_logits=True)
    assert calls == []


# ------------------------------------------------------------------------------- modules disagreeing with config
def _config_says_fewer_experts(model):
    model.config.n_routed_experts = 4  # the model was built with 8


def _router_of_another_size(model):
    router_class = type(model.model.layers[1].mlp.gate)
    model.model.layers[1].mlp.gate = router_class(tiny_deepseek_v3_config(n_routed_experts=8))


def _experts_removed(model):
    del model.model.layers[1].mlp.experts


MISMATCHES = {
    # name: (config overrides at build, change to the model, message fragments)
    "config_fewer_experts": (
        {"n_routed_experts": 8},
        _config_says_fewer_experts,
        [
            "model.layers.1.mlp.gate.weight has shape (8, 32); the config implies (4, 32)",
            "model.layers.1.mlp.gate.e_score_correction_bias has shape (8,); the config implies (4,)",
            "model.layers.1.mlp.experts.gate_up_proj has shape (8, 32, 32); the config implies (4, 32, 32)",
            "model.layers.1.mlp.experts.down_proj has shape (8, 32, 16); the config implies (4, 32, 16)",
        ],
    ),
    "router_of_another_size": (
        {},
        _router_of_another_size,
        [
            "model.layers.1.mlp.gate.weight has shape (8, 32); the config implies (4, 32)",
            "model.layers.1.mlp.gate.e_score_correction_bias has shape (8,); the config implies (4,)",
        ],
    ),
    "experts_missing": ({}, _experts_removed, ["model.layers.1.mlp.experts is missing"]),
}


@pytest.mark.parametrize("case", MISMATCHES)
def test_model_disagreeing_with_its_config_is_refused_unchanged(case):
    overrides, change, fragments = MISMATCHES[case]
    model = build_model(tiny_deepseek_v3_config(**overrides))
    change(model)
    types = module_types(model)
    before = snapshot_modeling_globals()

    with pytest.raises(ValueError, match="does not match its config") as raised:
        apply_liger_kernel_to_deepseek_v3(model=model)

    message = str(raised.value)
    for fragment in fragments:
        assert fragment in message
    assert message.count("\n") == len(fragments)  # one line per problem, nothing else reported
    assert module_types(model) == types and "forward" not in vars(model)
    assert changed_modeling_globals(before) == []


def test_model_without_moe_layers_passes_the_checks():
    model = build_model(tiny_deepseek_v3_config(first_k_dense_replace=2))
    assert not any(isinstance(m, modeling_module().DeepseekV3MoE) for m in model.modules())
    report = apply_liger_kernel_to_deepseek_v3(model=model)
    assert {r.target for r in report} >= {"DeepseekV3RMSNorm modules", "DeepseekV3MLP modules"}


# ---------------------------------------------------------------------------------------- unsupported versions
REAL_VERSION = metadata.version
VERSION_CASES = {
    # name: (package, version found or None for not installed, message fragment)
    "liger_kernel_too_old": ("liger-kernel", "0.8.4", "liger-kernel >= 0.8.5, < 0.9; found 0.8.4"),
    "liger_kernel_too_new": ("liger-kernel", "0.9.0", "liger-kernel >= 0.8.5, < 0.9; found 0.9.0"),
    "transformers_too_old": ("transformers", "5.8.0", "transformers >= 5.8.1, < 6; found 5.8.0"),
    "transformers_6": ("transformers", "6.0.0", "transformers >= 5.8.1, < 6; found 6.0.0"),
    "liger_kernel_missing": ("liger-kernel", None, "liger-kernel >= 0.8.5, < 0.9, which is not installed"),
}


def fake_version(package: str, version: str | None):
    def version_of(name):
        if name != package:
            return REAL_VERSION(name)
        if version is None:
            raise metadata.PackageNotFoundError(name)
        return version

    return version_of


@pytest.mark.parametrize("case", VERSION_CASES)
@pytest.mark.parametrize("scope", ["class", "instance"])
def test_unsupported_versions_fail_at_apply_time(monkeypatch, case, scope):
    package, version, fragment = VERSION_CASES[case]
    monkeypatch.setattr(metadata, "version", fake_version(package, version))
    model = build_model(tiny_deepseek_v3_config()) if scope == "instance" else None
    types = module_types(model) if model is not None else None
    before = snapshot_modeling_globals()

    with pytest.raises(ImportError, match="liger-dspine") as raised:
        if model is None:
            apply_liger_kernel_to_deepseek_v3()
        else:
            apply_liger_kernel_to_instance(model)

    assert fragment in str(raised.value)
    assert 'pip install "liger-kernel>=0.8.5,<0.9" "transformers>=5.8.1,<6"' in str(raised.value)
    assert changed_modeling_globals(before) == []
    if model is not None:
        assert module_types(model) == types


def test_supported_range_is_the_one_named_in_errors():
    assert {name: tuple(map(str, bounds)) for name, bounds in SUPPORTED.items()} == {
        "liger-kernel": ("0.8.5", "0.9"),
        "transformers": ("5.8.1", "6"),
    }


IMPORT_SCRIPT = """
import json, sys
from importlib import metadata
real = metadata.version
metadata.version = lambda name: {"liger-kernel": "0.7.0", "transformers": "4.57.0"}.get(name) or real(name)
sys.path.insert(0, sys.argv[1])
import liger_dspine
from tiny_models import build_model, tiny_deepseek_v3_config
try:
    liger_dspine.apply_liger_kernel_to_instance(build_model(tiny_deepseek_v3_config()))
    error = None
except ImportError as raised:
    error = str(raised)
print(json.dumps({"error": error, "kernels_imported": [m for m in sys.modules if m.startswith("liger_kernel.ops")]}))
"""


def test_import_succeeds_with_unsupported_versions():
    """The version check runs when a patch is applied, not when ``liger_dspine`` is imported."""
    env = {**os.environ, "LIGER_DSPINE_INTERPRET": "1"}
    test_dir = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_SCRIPT, str(test_dir)], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert "liger-kernel >= 0.8.5, < 0.9; found 0.7.0" in report["error"]
    assert report["kernels_imported"] == []


@pytest.mark.parametrize(
    ("package", "version", "warns"),
    [("transformers", "5.99.0", True), ("transformers", "5.25.0", False), ("liger-kernel", "0.8.9", True)],
)
def test_newer_than_tested_version_warns_once(monkeypatch, caplog, package, version, warns):
    from liger_dspine import _versions

    monkeypatch.setattr(metadata, "version", fake_version(package, version))
    monkeypatch.setattr(_versions, "_warned", set())
    with caplog.at_level("WARNING", logger="liger_dspine._versions"):
        _versions.require_supported_versions()
        _versions.require_supported_versions()
    messages = [r.getMessage() for r in caplog.records if "newer than the newest version tested" in r.getMessage()]
    newest = _versions.NEWEST_TESTED[package]
    expected = f"liger-dspine: {package} {version} is newer than the newest version tested ({newest}); the patch"
    assert len(messages) == (1 if warns else 0)
    assert all(message.startswith(expected) for message in messages)


@pytest.mark.parametrize("shifted", [True, False])
def test_the_label_check_ops_of_a_compiled_gpu_step_refuse_a_bad_label(shifted):
    """The two ops a compiled step on a GPU checks its labels with (bounds to the host, then the check), run on a
    CPU: labels in range come back as a copy; a label outside is refused by name, unless it is the first position
    of a row that the loss shifts away."""
    from liger_dspine.modules import label_checks

    labels = torch.tensor([[7, 3, -100, 9], [0, 9, 4, -100]])
    bounds = label_checks._label_bounds_to_host_op(labels, -100, shifted)
    assert bounds.tolist() == [0, 9]  # 0 stands in for the ignored labels
    checked = label_checks._finish_label_check_op(labels, bounds, labels, 10, -100, shifted)
    assert torch.equal(checked, labels) and checked.data_ptr() != labels.data_ptr()
    labels[0, 0] = 10  # a first position: a target only when not shifted by the loss
    bounds = label_checks._label_bounds_to_host_op(labels, -100, shifted)
    if shifted:
        with pytest.raises(ValueError, match=r"labels must be in \[0, 10\).*1 label\(s\) are outside, with values "):
            label_checks._finish_label_check_op(labels, bounds, labels, 10, -100, shifted)
    else:
        assert torch.equal(label_checks._finish_label_check_op(labels, bounds, labels, 10, -100, shifted), labels)
