"""apply_liger_kernel_to_dspine: what it swaps (class level and instance level), idempotence, revert, the registry,
checkpoints, and native-vs-patched training numerics.

Structural tests build tiny drafters and run no kernel. Numerics run the kernels: on CPU through Triton's
interpreter (fp32 only, slow, so a few steps of the tiny set-up), in bf16 on CUDA. Tolerances as in dspine.md
section 7.4: 2e-5 in fp32; 0.02 on the loss and a gradient cosine above 0.999 in bf16.
"""

import copy
import json

import pytest
import torch
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from liger_dspine import MODEL_TYPE_TO_APPLY_LIGER_FN
from liger_dspine import apply_liger_kernel
from liger_dspine import apply_liger_kernel_to_dspine
from liger_dspine import apply_liger_kernel_to_instance
from liger_dspine import revert_liger_kernel_to_dspine
from liger_dspine.models.dspine import DSpineAccumulationWindow
from liger_dspine.models.dspine import DSpineDraftModel
from liger_dspine.models.dspine import DSpineObjective
from liger_dspine.models.dspine import builders
from liger_dspine.models.dspine.attention import DSpineAttention
from liger_dspine.models.dspine.fused_switch import fused_objective_on
from liger_dspine.models.dspine.injection import AdjacentInjection
from liger_dspine.models.dspine.liger_attention import LigerDSpineAttention
from liger_dspine.models.dspine.liger_injection import LigerAdjacentInjection
from liger_dspine.models.dspine.mla_attention import DSpineMLAAttention
from liger_dspine.models.dspine.objective import BACKBONE_CE
from liger_dspine.modules.rms_norm import LigerRMSNorm
from liger_dspine.modules.swiglu import LigerSwiGLUMLP
from tiny_dspine import TINY_MASK_TOKEN
from tiny_dspine import seeded_draft
from tiny_dspine import target_batch
from tiny_dspine import tiny_draft_config
from tiny_dspine import tiny_target
from tiny_dspine import to_device

N_LAYERS = 2  # tiny_draft_config
NORM_NAMES = [
    f"layers.{i}.{name}"
    for i in range(N_LAYERS)
    for name in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm")
] + ["hidden_norm", "norm"]
PATCHED_GLOBALS = [
    "liger_dspine.models.dspine.builders.Qwen3RMSNorm",
    "liger_dspine.models.dspine.builders.Qwen3MLP",
    "liger_dspine.models.dspine.builders.DSpineAttention",
    "liger_dspine.models.dspine.builders.DSpineMLAAttention",
    "liger_dspine.models.dspine.builders.AdjacentInjection",
    "liger_dspine.models.dspine.objective.DSpineObjective.patched_fused_objective",
]
NATIVE_SWITCH = DSpineObjective.patched_fused_objective


def assert_native_globals() -> None:
    assert builders.Qwen3RMSNorm is Qwen3RMSNorm
    assert builders.Qwen3MLP is Qwen3MLP
    assert builders.AdjacentInjection is AdjacentInjection
    assert builders.DSpineAttention is DSpineAttention
    assert builders.DSpineMLAAttention is DSpineMLAAttention
    assert DSpineObjective.patched_fused_objective is NATIVE_SWITCH


@pytest.fixture
def class_level():
    """For tests that patch at class level: every global is native before, and reverted (and checked) after."""
    assert_native_globals()
    yield
    revert_liger_kernel_to_dspine()
    assert_native_globals()


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def build_draft(target, seed=5, dtype=torch.float32, device="cpu"):
    return to_device(seeded_draft(target, tiny_draft_config(), seed), device, dtype)


def build_objective(target, fused_objective=None, **kwargs):
    draft = build_draft(target, **kwargs)
    objective = DSpineObjective(
        draft,
        target.lm_head,
        target.model.embed_tokens,
        num_anchors=3,
        objective_chunk_blocks=2,
        fused_objective=fused_objective,
    )
    return objective.train()


def module_kinds(model) -> dict:
    return {name: type(model.get_submodule(name)) for name in NORM_NAMES} | {
        f"layers.{i}.mlp": type(model.layers[i].mlp) for i in range(N_LAYERS)
    }


def assert_kinds(model, norm: type, mlp: type, injection: type | None = None, attention: type | None = None) -> None:
    expected = {name: norm for name in NORM_NAMES} | {f"layers.{i}.mlp": mlp for i in range(N_LAYERS)}
    assert module_kinds(model) == expected
    if injection is not None:
        assert type(model.injection) is injection
    if attention is not None:
        assert [type(layer.self_attn) for layer in model.layers] == [attention] * N_LAYERS
    # nothing else holds a norm or an MLP of the other kind
    other_norm = Qwen3RMSNorm if norm is LigerRMSNorm else LigerRMSNorm
    other_mlp = Qwen3MLP if mlp is LigerSwiGLUMLP else LigerSwiGLUMLP
    assert not any(isinstance(module, (other_norm, other_mlp)) for module in model.modules())


def assert_native(model) -> None:
    assert_kinds(model, Qwen3RMSNorm, Qwen3MLP, AdjacentInjection, DSpineAttention)


def assert_liger(model) -> None:
    assert_kinds(model, LigerRMSNorm, LigerSwiGLUMLP, LigerAdjacentInjection, LigerDSpineAttention)
    for name in NORM_NAMES:
        norm = model.get_submodule(name)
        assert norm.casting_mode == "llama" and not norm.in_place and norm.variance_epsilon == 1e-6, name


def report_lines(report) -> list[tuple]:
    return [(r.target, r.old, r.new, r.count, r.already) for r in report]


# --------------------------------------------------------------------------------------------------- class level
def test_class_level_patch_reaches_models_built_afterwards(class_level, target):
    before = build_objective(target)
    explicit_eager = build_objective(target, fused_objective=False)
    report = apply_liger_kernel_to_dspine()
    assert report.scope == "class" and [r.target for r in report] == PATCHED_GLOBALS
    assert not any(r.already for r in report)
    assert builders.Qwen3RMSNorm is LigerRMSNorm and builders.Qwen3MLP is LigerSwiGLUMLP
    assert builders.AdjacentInjection is LigerAdjacentInjection
    assert DSpineObjective.patched_fused_objective is fused_objective_on
    assert "Qwen3RMSNorm -> liger_dspine.modules.rms_norm.LigerRMSNorm" in str(report)

    after = build_objective(target)
    assert_liger(after.draft_model)
    assert after.fused_objective
    # modules built before the patch stay native; the objective's switch is the class's, so an objective without
    # an explicit choice follows the patch, and an explicit choice wins over it
    assert_native(before.draft_model)
    assert before.fused_objective
    assert not explicit_eager.fused_objective
    assert not build_objective(target, fused_objective=False).fused_objective


@pytest.mark.parametrize(
    "options, norm, mlp, fused",
    [
        ({"rms_norm": False}, Qwen3RMSNorm, LigerSwiGLUMLP, True),
        ({"swiglu": False}, LigerRMSNorm, Qwen3MLP, True),
        ({"fused_objective": False}, LigerRMSNorm, LigerSwiGLUMLP, False),
    ],
    ids=["no_rms_norm", "no_swiglu", "no_fused_objective"],
)
def test_class_level_options_choose_the_swaps(class_level, target, options, norm, mlp, fused):
    report = apply_liger_kernel_to_dspine(**options)
    assert len(report) == 5
    objective = build_objective(target)
    assert_kinds(objective.draft_model, norm, mlp)
    assert objective.fused_objective is fused


def test_class_level_idempotence_and_revert(class_level, target):
    first = apply_liger_kernel_to_dspine()
    second = apply_liger_kernel_to_dspine()
    assert [(r.target, r.old, r.new) for r in second] == [(r.target, r.old, r.new) for r in first]
    assert all(r.already for r in second) and "(already patched)" in str(second)
    # one revert puts back the objects found before the first apply (identity)
    assert revert_liger_kernel_to_dspine() == PATCHED_GLOBALS
    assert_native_globals()
    assert revert_liger_kernel_to_dspine() == []
    objective = build_objective(target)
    assert_native(objective.draft_model)
    assert not objective.fused_objective
    assert build_objective(target, fused_objective=True).fused_objective


def test_drafter_built_under_the_class_patch_reports_already_patched(class_level, target):
    apply_liger_kernel_to_dspine()
    objective = build_objective(target)
    report = apply_liger_kernel_to_dspine(model=objective)
    assert [(r.count, r.already) for r in report] == [(10, True), (2, True), (2, True), (1, True), (1, True)]
    # the switch is bound to the objective too: the instance patch outlives a revert of the class level
    revert_liger_kernel_to_dspine()
    assert objective.fused_objective and not build_objective(target).fused_objective


# ------------------------------------------------------------------------------------------------ instance level
def test_instance_patch_of_a_drafter(target):
    draft, other = build_draft(target), build_draft(target)
    parameters = {name: id(p) for name, p in draft.named_parameters()}
    state = {key: value.clone() for key, value in draft.state_dict().items()}
    report = apply_liger_kernel_to_dspine(model=draft)
    assert report.scope == "instance"
    assert [(r.target, r.count, r.already) for r in report] == [
        ("Qwen3RMSNorm modules", 10, False),
        ("Qwen3MLP modules", 2, False),
        ("DSpineAttention modules", 2, False),
        ("AdjacentInjection modules", 1, False),
    ]  # a drafter holds no objective: fused_objective finds nothing to replace
    assert_liger(draft)
    # converted in place: the same parameters, the same values
    assert {name: id(p) for name, p in draft.named_parameters()} == parameters
    assert all(torch.equal(draft.state_dict()[key], value) for key, value in state.items())
    assert_native(other)
    assert_native_globals()


def test_instance_patch_of_an_objective(target):
    objective, other = build_objective(target), build_objective(target)
    report = apply_liger_kernel_to_dspine(model=objective)
    assert report_lines(report)[4] == (
        "DSpineObjective.patched_fused_objective of the instance",
        "liger_dspine.models.dspine.objective.DSpineObjective.patched_fused_objective",
        "liger_dspine.models.dspine.fused_switch.fused_objective_on",
        1,
        False,
    )
    assert_liger(objective.draft_model)
    assert objective.fused_objective
    # the other instance and the class stay native
    assert_native(other.draft_model)
    assert not other.fused_objective
    assert_native_globals()
    assert_native(build_objective(target).draft_model)


def test_instance_patch_options(target):
    objective = build_objective(target)
    report = apply_liger_kernel_to_dspine(rms_norm=False, fused_objective=False, model=objective)
    assert [r.target for r in report] == ["Qwen3MLP modules", "DSpineAttention modules", "AdjacentInjection modules"]
    assert_kinds(objective.draft_model, Qwen3RMSNorm, LigerSwiGLUMLP, LigerAdjacentInjection)
    assert not objective.fused_objective


def test_instance_idempotence(target):
    objective = build_objective(target)
    first = apply_liger_kernel_to_dspine(model=objective)
    kinds = module_kinds(objective.draft_model)
    second = apply_liger_kernel_to_dspine(model=objective)
    assert [(r.target, r.count) for r in second] == [(r.target, r.count) for r in first]
    assert all(r.already for r in second) and not any(r.already for r in first)
    assert module_kinds(objective.draft_model) == kinds
    assert objective.fused_objective


@pytest.mark.parametrize("model", [lambda target: target, lambda target: nn.Linear(2, 2)], ids=["qwen3", "linear"])
def test_wrong_model_class_is_refused(target, model):
    model = model(target)
    kinds = [type(module) for module in model.modules()]
    with pytest.raises(TypeError, match="DSpinePreTrainedModel or DSpineObjective") as error:
        apply_liger_kernel_to_dspine(model=model)
    assert type(model).__name__ in str(error.value)
    assert [type(module) for module in model.modules()] == kinds
    assert_native_globals()


# ------------------------------------------------------------------------------------------------------ registry
def test_registry_serves_dspine(class_level, target):
    assert MODEL_TYPE_TO_APPLY_LIGER_FN["dspine"] is apply_liger_kernel_to_dspine
    with pytest.raises(TypeError, match="'bogus'"):
        apply_liger_kernel("dspine", bogus=1)
    assert_native_globals()  # a refused call changes nothing

    draft = build_draft(target)
    assert draft.config.model_type == "dspine"
    apply_liger_kernel_to_instance(draft, swiglu=False)
    assert_kinds(draft, LigerRMSNorm, Qwen3MLP)
    assert_native_globals()

    report = apply_liger_kernel("dspine", fused_objective=False)
    assert [r.target for r in report] == PATCHED_GLOBALS[:5]
    assert_liger(build_draft(target))


# --------------------------------------------------------------------------------------------------- checkpoints
def test_state_dict_and_strict_loading(class_level, target):
    native = build_draft(target)
    patched = copy.deepcopy(native)
    apply_liger_kernel_to_dspine(model=patched)
    assert list(patched.state_dict()) == list(native.state_dict())
    apply_liger_kernel_to_dspine()
    built_patched = DSpineDraftModel(tiny_draft_config())
    assert list(built_patched.state_dict()) == list(native.state_dict())
    # strict loading both ways
    assert not any(built_patched.load_state_dict(native.state_dict(), strict=True))
    revert_liger_kernel_to_dspine()
    fresh_native = DSpineDraftModel(tiny_draft_config())
    assert not any(fresh_native.load_state_dict(patched.state_dict(), strict=True))
    for key, value in native.state_dict().items():
        assert torch.equal(built_patched.state_dict()[key], value), key
        assert torch.equal(fresh_native.state_dict()[key], value), key


def test_save_pretrained_reloads_native(tmp_path, target):
    patched = build_draft(target)
    apply_liger_kernel_to_dspine(model=patched)
    patched.save_pretrained(tmp_path)
    assert "liger" not in (tmp_path / "config.json").read_text().lower()
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["DSpineDraftModel"]
    reloaded = DSpineDraftModel.from_pretrained(tmp_path)
    assert_native(reloaded)
    for key, value in patched.state_dict().items():
        assert torch.equal(reloaded.state_dict()[key], value), key


# ------------------------------------------------------------------------------------------------------ numerics
def make_batches(target, count, device="cpu"):
    batches = []
    for seed in range(1, count + 1):
        generator = torch.Generator().manual_seed(seed)
        input_ids = torch.randint(0, TINY_MASK_TOKEN, (2, 10), generator=generator)
        loss_mask = torch.ones(2, 10)
        loss_mask[0, : seed + 1] = 0
        batches.append(target_batch(target, input_ids.to(device), loss_mask.to(device)).as_kwargs())
    return batches


def train(objective, batches, lr=0.05):
    """SGD steps (global steps 100, 101, ...: teacher forcing and alignment on), the same draws for every run.

    Returns per step: (loss fp32, {parameter: gradient fp32}, {metric: numerator}).
    """
    draft = objective.draft_model
    optimizer = torch.optim.SGD(draft.parameters(), lr=lr)
    records = []
    for step, batch in enumerate(batches):
        torch.manual_seed(1000 + step)
        out = objective(**batch, global_step=100 + step, total_steps=600)
        out.loss.backward()
        grads = {name: p.grad.detach().float().clone() for name, p in draft.named_parameters()}
        metrics = {name: pair[0].detach().float() for name, pair in out.ratio_metrics.items()}
        metrics["accuracy"] = out.accuracy.detach()
        records.append((out.loss.detach().float(), grads, metrics))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return records


def flat(grads: dict) -> torch.Tensor:
    return torch.cat([grads[name].flatten() for name in sorted(grads)])


def compare_fp32(native_records, patched_records, tolerance=2e-5):
    for (loss, grads, metrics), (patched_loss, patched_grads, patched_metrics) in zip(native_records, patched_records):
        torch.testing.assert_close(patched_loss, loss, atol=tolerance, rtol=tolerance)
        assert patched_grads.keys() == grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(patched_grads[name], grad, atol=tolerance, rtol=tolerance, msg=name)
        for name, value in metrics.items():
            torch.testing.assert_close(patched_metrics[name], value, atol=tolerance, rtol=tolerance, msg=name)


@pytest.mark.parametrize("fused_objective", [True, False], ids=["fused_objective", "eager_objective"])
def test_patched_training_matches_native_fp32(target, fused_objective):
    native = build_objective(target)
    patched = copy.deepcopy(native)
    report = apply_liger_kernel_to_dspine(fused_objective=fused_objective, model=patched)
    assert len(report) == (5 if fused_objective else 4)
    assert patched.fused_objective is fused_objective
    batches = make_batches(target, 2)
    compare_fp32(train(native, batches), train(patched, batches))
    for (name, p), q in zip(native.draft_model.named_parameters(), patched.draft_model.parameters()):
        torch.testing.assert_close(q, p, atol=2e-5, rtol=2e-5, msg=name)


@pytest.mark.cuda
@pytest.mark.parametrize("fused_objective", [True, False], ids=["fused_objective", "eager_objective"])
def test_patched_training_matches_native_cuda_bf16(fused_objective):
    target = tiny_target(dtype=torch.bfloat16).to("cuda")
    native = build_objective(target, dtype=torch.bfloat16, device="cuda")
    patched = copy.deepcopy(native)
    apply_liger_kernel_to_dspine(fused_objective=fused_objective, model=patched)
    batches = make_batches(target, 3, device="cuda")
    for (loss, grads, _), (patched_loss, patched_grads, _) in zip(train(native, batches), train(patched, batches)):
        assert abs(patched_loss.item() - loss.item()) <= max(0.02, 0.02 * abs(loss.item()))
        assert all(torch.isfinite(g).all() for g in patched_grads.values())
        assert torch.nn.functional.cosine_similarity(flat(patched_grads), flat(grads), dim=0) > 0.999
    assert target.lm_head.weight.grad is None and target.model.embed_tokens.weight.grad is None
    assert torch.equal(patched.draft_model.transfer_codes, native.draft_model.transfer_codes)


def test_fused_objective_matches_eager_with_the_prepass(target):
    """DSpineObjective(fused_objective=True) against the eager terms: CE-only prepass, full loss, gradients."""
    eager = build_objective(target)
    fused = build_objective(target, fused_objective=True)
    assert fused.fused_objective and not eager.fused_objective
    batch = make_batches(target, 1)[0]
    results = []
    for objective in (eager, fused):
        torch.manual_seed(21)
        with torch.no_grad():
            prepass = objective(**batch, global_step=100, total_steps=600, ce_only=True)
        torch.manual_seed(21)  # the same anchors and teacher-forcing draw as the prepass
        full = objective(**batch, global_step=100, total_steps=600)
        full.loss.backward()
        grads = {name: p.grad.clone() for name, p in objective.draft_model.named_parameters()}
        results.append((prepass, full, grads))
    (eager_prepass, eager_full, eager_grads), (fused_prepass, fused_full, fused_grads) = results

    # CE sums of ~18 fp32 rows of O(5): a few ulps apart
    fused_ce, fused_d = fused_prepass.ratio_metrics[BACKBONE_CE]
    eager_ce, eager_d = eager_prepass.ratio_metrics[BACKBONE_CE]
    torch.testing.assert_close(fused_ce, eager_ce, atol=1e-5, rtol=1e-6)
    assert torch.equal(fused_d, eager_d) and torch.equal(fused_prepass.accuracy, eager_prepass.accuracy)
    torch.testing.assert_close(fused_full.ratio_metrics[BACKBONE_CE][0], fused_ce, atol=1e-5, rtol=1e-6)

    torch.testing.assert_close(fused_full.loss, eager_full.loss, atol=2e-5, rtol=2e-5)
    for name, (value, _) in eager_full.ratio_metrics.items():
        torch.testing.assert_close(fused_full.ratio_metrics[name][0], value, atol=2e-5, rtol=2e-5, msg=name)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, atol=2e-5, rtol=2e-5, msg=name)


def window_step(objective, batches):
    window = DSpineAccumulationWindow(objective, accumulation_steps=len(batches))
    torch.manual_seed(33)
    prepass_ce = sum(window.prepass(batch, global_step=100, total_steps=600).loss_terms[0] for batch in batches)
    outputs = window.replay()
    loss = sum(o.loss_terms[0].detach() for o in outputs) / sum(o.loss_terms[1] for o in outputs)
    grads = {name: p.grad.clone() for name, p in objective.draft_model.named_parameters()}
    return prepass_ce, loss, grads


def test_accumulation_window_with_the_fused_objective(target):
    """Prepasses and replays through the fused frozen-head terms (the Liger norms and MLPs through the window are
    covered by test_dspine_liger.py)."""
    eager = build_objective(target)
    patched = copy.deepcopy(eager)
    apply_liger_kernel_to_dspine(rms_norm=False, swiglu=False, model=patched)
    assert patched.fused_objective
    batches = make_batches(target, 2)
    (eager_ce, eager_loss, eager_grads), (patched_ce, patched_loss, patched_grads) = (
        window_step(objective, batches) for objective in (eager, patched)
    )
    torch.testing.assert_close(patched_ce, eager_ce, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(patched_loss, eager_loss, atol=2e-5, rtol=2e-5)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(patched_grads[name], grad, atol=2e-5, rtol=2e-5, msg=name)


# ---------------------------------------------------------------------------------------------------------- demo
@pytest.mark.slow  # the DSpine demo, patched through the interpreter: make test-slow
def test_dspine_demo_runs(capsys):
    from liger_dspine.demo_dspine import run_dspine_demo

    assert run_dspine_demo(steps=2, seed=0) == 0
    printed = capsys.readouterr().out
    assert "result: patched and native runs give the same losses" in printed and "fused_objective_on" in printed
    assert_native_globals()


def test_instance_patched_objective_round_trips_through_pickle(target):
    import pickle

    objective = build_objective(target)
    apply_liger_kernel_to_dspine(model=objective)
    loaded = pickle.loads(pickle.dumps(objective))
    assert loaded.fused_objective and type(loaded.draft_model.norm) is LigerRMSNorm
    assert type(loaded.draft_model.injection) is LigerAdjacentInjection
    batch = make_batches(target, 1)[0]
    losses = []
    for model in (objective, loaded):
        torch.manual_seed(21)
        losses.append(model(**batch, global_step=100, total_steps=600).loss)
    torch.testing.assert_close(losses[1], losses[0], atol=0, rtol=0)
