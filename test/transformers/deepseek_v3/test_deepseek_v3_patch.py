"""The DeepSeek-V3 patch: what it swaps (class level and instance level), idempotence, revert, strict options.

Structural tests build tiny models and never run a kernel, except the save/load round trip (one eval forward)
and the check that a CPU tensor without the interpreter fails with a clear message (a subprocess).
"""

import copy
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers import DeepseekV3ForCausalLM
from transformers import LlamaConfig
from transformers import LlamaForCausalLM

from liger_dspine import apply_liger_kernel_to_deepseek_v3
from liger_dspine import revert_liger_kernel_to_deepseek_v3
from liger_dspine.models.deepseek_v3.attention import LigerDeepseekV3Attention
from liger_dspine.models.deepseek_v3.attention import LigerDeepseekV3RecomputeAttention
from liger_dspine.models.deepseek_v3.router import LigerDeepseekV3TopkRouter
from liger_dspine.models.deepseek_v3.router import liger_route_tokens_to_experts
from liger_dspine.modules.causal_lm_forward import ce_forward
from liger_dspine.modules.causal_lm_forward import lce_forward
from liger_dspine.modules.causal_lm_forward import lce_forward_vocab_chunked
from liger_dspine.modules.experts import LigerFusedExperts
from liger_dspine.modules.grouped_experts import LigerGroupedExperts
from liger_dspine.modules.rms_norm import LigerRMSNorm
from liger_dspine.modules.swiglu import LigerSwiGLUMLP
from liger_dspine.patching import replacement_of
from tiny_models import assert_transformers_native
from tiny_models import build_model
from tiny_models import changed_modeling_globals
from tiny_models import class_patches_reverted
from tiny_models import modeling_module
from tiny_models import module_types
from tiny_models import native_experts_class
from tiny_models import random_batch
from tiny_models import snapshot_modeling_globals
from tiny_models import tiny_deepseek_v3_config

pytestmark = pytest.mark.matrix  # runs against every transformers version of the matrix

MODELING = modeling_module()
# captured at import, while transformers is native (class-level patches rebind the module globals)
NATIVE_FORWARD = MODELING.DeepseekV3ForCausalLM.forward
NATIVE_RMS_NORM = MODELING.DeepseekV3RMSNorm
NATIVE_MLP = MODELING.DeepseekV3MLP
NATIVE_EXPERTS = native_experts_class()
NATIVE_ROUTER = MODELING.DeepseekV3TopkRouter
NATIVE_ATTENTION = MODELING.DeepseekV3Attention
# transformers < 5.13 routes in DeepseekV3MoE.route_tokens_to_experts, which the moe_router option also replaces
ROUTES_IN_MOE_BLOCK = "route_tokens_to_experts" in vars(MODELING.DeepseekV3MoE)

# config overrides -> expected module counts (RMSNorm, MLP = dense + shared experts, MoE layers); 2 layers each
CONFIG_CASES = {
    # 2 layers x (input, post-attention, q_a, kv_a) + final norm; 1 dense MLP + 1 shared expert; 1 MoE layer
    "q_lora": ({}, 9, 2, 1),
    # no q_a_layernorm
    "no_q_lora": ({"q_lora_rank": None}, 7, 2, 1),
    # every layer is MoE: 2 shared experts, 2 routed experts modules, no dense MLP
    "no_dense": ({"first_k_dense_replace": 0}, 9, 2, 2),
}
N_LAYERS = 2

OPTION_CASES = {
    "defaults": {},
    "no_rms_norm": {"rms_norm": False},
    "no_swiglu": {"swiglu": False},
    "fused_experts": {"fused_experts": True},
    "fused_experts_without_swiglu": {"swiglu": False, "fused_experts": True},
    "native_experts": {"grouped_experts": False},
    "vocab_chunked_lce": {"vocab_chunked_lce": True},
    "recompute_attention": {"recompute_attention": True},
    "no_moe_router": {"moe_router": False},
    "no_rope": {"rope": False},
    "no_loss_forward": {"fused_linear_cross_entropy": False},
    "cross_entropy": {"cross_entropy": True, "fused_linear_cross_entropy": False},
}
# the options and their defaults, as the apply function declares them
DEFAULTS = {
    name: p.default
    for name, p in inspect.signature(apply_liger_kernel_to_deepseek_v3).parameters.items()
    if name != "model"
}


def swap_table(options: dict) -> dict[type, type]:
    """Native class -> the class it becomes under ``options`` (absent: stays native)."""
    table = {}
    if options["rms_norm"]:
        table[NATIVE_RMS_NORM] = LigerRMSNorm
    if options["swiglu"]:
        table[NATIVE_MLP] = LigerSwiGLUMLP
        if options["fused_experts"]:
            table[NATIVE_EXPERTS] = LigerFusedExperts
        elif options["grouped_experts"]:
            table[NATIVE_EXPERTS] = LigerGroupedExperts
    if options["moe_router"]:
        table[NATIVE_ROUTER] = LigerDeepseekV3TopkRouter
    if options["rope"]:
        recompute = options["recompute_attention"]
        table[NATIVE_ATTENTION] = LigerDeepseekV3RecomputeAttention if recompute else LigerDeepseekV3Attention
    return table


def expected_instance_report(options: dict, n_norms: int, n_mlps: int, n_moe: int) -> dict[str, int]:
    """Report target -> modules converted, for an instance patch of a native model."""
    counts = {}
    if options["rms_norm"]:
        counts["DeepseekV3RMSNorm modules"] = n_norms
    if options["swiglu"]:
        counts["DeepseekV3MLP modules"] = n_mlps
        if options["fused_experts"] or options["grouped_experts"]:
            counts[f"{NATIVE_EXPERTS.__name__} modules"] = n_moe
    if options["rope"]:
        counts["DeepseekV3Attention modules"] = N_LAYERS
    if options["moe_router"]:
        counts["DeepseekV3TopkRouter modules"] = n_moe
        if ROUTES_IN_MOE_BLOCK:
            counts["DeepseekV3MoE.route_tokens_to_experts of the instance"] = n_moe
    if expected_forward(options) is not NATIVE_FORWARD:
        counts["DeepseekV3ForCausalLM.forward of the instance"] = 1
    return counts


def expected_changed_globals(options: dict) -> set[str]:
    """What a class-level patch rebinds (module globals and class attributes)."""
    changed = {cls.__name__ for cls in swap_table(options)}
    if options["moe_router"] and ROUTES_IN_MOE_BLOCK:
        changed.add("DeepseekV3MoE.route_tokens_to_experts")
    if expected_forward(options) is not NATIVE_FORWARD:
        changed.add("DeepseekV3ForCausalLM.forward")
    return changed


def expected_forward(options: dict):
    if options["fused_linear_cross_entropy"]:
        return lce_forward_vocab_chunked if options["vocab_chunked_lce"] else lce_forward
    if options["cross_entropy"]:
        return ce_forward
    return NATIVE_FORWARD


def assert_swapped(native_types: dict[str, type], model, options: dict) -> None:
    """Every module has the native type, or its replacement where ``options`` enable one; nothing else changed."""
    table = swap_table(options)
    patched_types = module_types(model)
    assert set(patched_types) <= set(native_types)
    replaced = [name for name, native in native_types.items() if native in table]
    # a replacement built from scratch (class level) may lack a stateless child, such as the MLP's act_fn
    missing = set(native_types) - set(patched_types)
    assert all(any(name.startswith(parent + ".") for parent in replaced) for name in missing), missing
    wrong = {
        name: (native.__name__, patched_types[name].__name__)
        for name, native in native_types.items()
        if name in patched_types and patched_types[name] is not table.get(native, native)
    }
    assert not wrong, f"module name: (native, patched) not as expected: {wrong}"


def count_types(types: dict[str, type]) -> tuple[int, int, int]:
    values = list(types.values())
    return (
        values.count(NATIVE_RMS_NORM),
        values.count(NATIVE_MLP),
        values.count(NATIVE_EXPERTS),
    )


def test_options_are_a_superset_of_liger_kernels():
    """Drop-in for liger-kernel's function: every one of its parameters, in its order, plus keyword-only extras."""
    from liger_kernel.transformers import apply_liger_kernel_to_deepseek_v3 as liger_apply

    ours = inspect.signature(apply_liger_kernel_to_deepseek_v3).parameters
    theirs = inspect.signature(liger_apply).parameters
    assert list(ours)[: len(theirs)] == list(theirs)
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in list(ours.values())[len(theirs) :])
    assert DEFAULTS["fused_linear_cross_entropy"] is True and DEFAULTS["cross_entropy"] is False


@pytest.fixture
def class_level():
    """For tests that patch transformers' classes: revert afterwards and check every global is back."""
    with class_patches_reverted() as before:
        yield before


@pytest.mark.parametrize("option_case", OPTION_CASES)
@pytest.mark.parametrize("config_case", CONFIG_CASES)
def test_instance_patch_swaps_exactly_the_listed_modules(config_case, option_case):
    overrides, n_norms, n_mlps, n_experts = CONFIG_CASES[config_case]
    options = {**DEFAULTS, **OPTION_CASES[option_case]}
    model = build_model(tiny_deepseek_v3_config(**overrides))
    native_types = module_types(model)
    assert count_types(native_types) == (n_norms, n_mlps, n_experts)
    parameters = dict(model.named_parameters())

    report = apply_liger_kernel_to_deepseek_v3(model=model, **OPTION_CASES[option_case])

    assert_swapped(native_types, model, options)
    # modules are converted in place: the very same parameter objects
    assert {name: id(p) for name, p in model.named_parameters()} == {name: id(p) for name, p in parameters.items()}
    forward = expected_forward(options)
    if forward is NATIVE_FORWARD:
        assert "forward" not in vars(model)
    else:
        assert model.forward.__func__ is forward and model.forward.__self__ is model
    if options["moe_router"] and ROUTES_IN_MOE_BLOCK:
        for block in model.modules():
            if isinstance(block, MODELING.DeepseekV3MoE):
                assert block.route_tokens_to_experts.__func__ is liger_route_tokens_to_experts
    assert report.scope == "instance"
    assert {r.target: r.count for r in report} == expected_instance_report(options, n_norms, n_mlps, n_experts)
    assert not any(r.already for r in report)


@pytest.mark.parametrize("option_case", OPTION_CASES)
@pytest.mark.parametrize("config_case", CONFIG_CASES)
def test_class_patch_swaps_exactly_the_listed_modules(class_level, config_case, option_case):
    overrides, n_norms, n_mlps, n_experts = CONFIG_CASES[config_case]
    options = {**DEFAULTS, **OPTION_CASES[option_case]}
    config = tiny_deepseek_v3_config(**overrides)
    native = build_model(config)
    native_types = module_types(native)

    report = apply_liger_kernel_to_deepseek_v3(**OPTION_CASES[option_case])
    patched = build_model(config)

    assert report.scope == "class"
    assert_swapped(native_types, patched, options)
    assert replacement_of(DeepseekV3ForCausalLM.forward) is expected_forward(options)  # dressed as the native one
    assert "forward" not in vars(patched)
    for native_class, replacement in swap_table(options).items():
        assert getattr(MODELING, native_class.__name__) is replacement
    assert set(changed_modeling_globals(class_level)) == expected_changed_globals(options)
    assert len(report) == len(expected_changed_globals(options)) and not any(r.already for r in report)
    # the model built before the patch keeps its modules
    assert module_types(native) == native_types
    # same parameter and buffer names and shapes as the native model
    assert {k: v.shape for k, v in patched.state_dict().items()} == {k: v.shape for k, v in native.state_dict().items()}


def test_instance_patch_leaves_globals_and_other_instances_native():
    config = tiny_deepseek_v3_config()
    first, second = build_model(config), build_model(config)
    native_types = module_types(second)
    before = snapshot_modeling_globals()

    apply_liger_kernel_to_deepseek_v3(model=first)

    assert changed_modeling_globals(before) == []
    assert module_types(second) == native_types
    assert "forward" not in vars(second) and type(second).forward is NATIVE_FORWARD
    assert module_types(build_model(config)) == native_types
    assert_transformers_native()


def test_instance_patch_is_idempotent():
    model = build_model(tiny_deepseek_v3_config())
    apply_liger_kernel_to_deepseek_v3(model=model)
    types_once = module_types(model)
    forward_once = vars(model)["forward"]

    report = apply_liger_kernel_to_deepseek_v3(model=model)

    assert module_types(model) == types_once
    assert vars(model)["forward"] is forward_once
    assert forward_once.__func__ is lce_forward and forward_once.__self__ is model
    expected = expected_instance_report(DEFAULTS, 9, 2, 1)
    assert {r.target: r.count for r in report} == expected
    assert all(r.already for r in report)
    assert str(report).count("(already patched)") == len(expected)


def test_instance_patch_switches_loss_forward():
    model = build_model(tiny_deepseek_v3_config())
    apply_liger_kernel_to_deepseek_v3(model=model)
    report = apply_liger_kernel_to_deepseek_v3(model=model, cross_entropy=True, fused_linear_cross_entropy=False)

    assert model.forward.__func__ is ce_forward
    assert {r.target for r in report if not r.already} == {"DeepseekV3ForCausalLM.forward of the instance"}


def test_instance_patch_of_a_class_patched_model_changes_nothing(class_level):
    apply_liger_kernel_to_deepseek_v3()
    model = build_model(tiny_deepseek_v3_config())
    types = module_types(model)

    report = apply_liger_kernel_to_deepseek_v3(model=model)

    assert module_types(model) == types
    assert {r.target: r.count for r in report} == expected_instance_report(DEFAULTS, 9, 2, 1)
    assert all(r.already for r in report)
    # the loss forward is bound to the instance as well, so the instance patch outlives a class-level revert
    assert model.forward.__func__ is lce_forward


def test_class_patch_is_idempotent(class_level):
    apply_liger_kernel_to_deepseek_v3()
    after_first = snapshot_modeling_globals()

    report = apply_liger_kernel_to_deepseek_v3()

    assert changed_modeling_globals(after_first) == []
    assert all(r.already for r in report)
    # the report still names what transformers defined
    prefix = MODELING.__name__ + "."
    assert {r.old.removeprefix(prefix) for r in report} == expected_changed_globals(DEFAULTS)


def test_revert_restores_every_global_by_identity():
    assert_transformers_native()
    before = snapshot_modeling_globals()
    apply_liger_kernel_to_deepseek_v3()
    # a second apply with another loss path replaces lce_forward: the original must still come back
    apply_liger_kernel_to_deepseek_v3(cross_entropy=True, fused_linear_cross_entropy=False)
    assert replacement_of(DeepseekV3ForCausalLM.forward) is ce_forward

    restored = revert_liger_kernel_to_deepseek_v3()

    assert changed_modeling_globals(before) == []
    assert DeepseekV3ForCausalLM.forward is NATIVE_FORWARD
    assert sorted(restored) == sorted(f"{MODELING.__name__}.{name}" for name in expected_changed_globals(DEFAULTS))
    assert revert_liger_kernel_to_deepseek_v3() == []
    assert changed_modeling_globals(before) == []


def llama_model():
    config = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    return LlamaForCausalLM(config)


@pytest.mark.parametrize(
    "options, error, message",
    [
        (dict(cross_entropy=True, fused_linear_cross_entropy=True), ValueError, "cannot both be True"),
        (dict(model=llama_model()), TypeError, "DeepseekV3PreTrainedModel"),
        (dict(model=torch.nn.Linear(2, 2)), TypeError, "DeepseekV3PreTrainedModel"),
    ],
    ids=["both_losses", "llama_model", "linear_module"],
)
def test_refused_options_change_nothing(options, error, message):
    before = snapshot_modeling_globals()
    model = options.get("model")
    types = module_types(model) if model is not None else None

    with pytest.raises(error, match=message):
        apply_liger_kernel_to_deepseek_v3(**options)

    assert changed_modeling_globals(before) == []
    if model is not None:
        assert module_types(model) == types and "forward" not in vars(model)


def test_state_dict_keys_and_tensors_unchanged_by_instance_patch():
    model = build_model(tiny_deepseek_v3_config())
    before = model.state_dict()
    apply_liger_kernel_to_deepseek_v3(model=model)
    after = model.state_dict()

    assert list(after) == list(before)
    assert all(after[k] is before[k] or after[k].data_ptr() == before[k].data_ptr() for k in before)


def test_checkpoint_of_patched_model_loads_into_native_transformers(tmp_path):
    config = tiny_deepseek_v3_config()
    native = build_model(config).eval()
    patched = copy.deepcopy(native)
    apply_liger_kernel_to_deepseek_v3(model=patched)
    input_ids, _ = random_batch(config, batch=1, seq=6)

    patched.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()

    assert module_types(loaded) == module_types(native) and "forward" not in vars(loaded)
    with torch.no_grad():
        native_logits = native(input_ids).logits
        loaded_logits = loaded(input_ids).logits
        patched_logits = patched(input_ids).logits
    assert torch.equal(loaded_logits, native_logits)
    # fp32 kernels through the interpreter against eager: rounding differences only
    torch.testing.assert_close(patched_logits, native_logits, atol=1e-5, rtol=1e-5)


NO_INTERPRETER_SCRIPT = """
import inspect, json, sys
import torch
sys.path.insert(0, sys.argv[1])
import liger_dspine
from tiny_models import build_model, random_batch, tiny_deepseek_v3_config

config = tiny_deepseek_v3_config()
input_ids, labels = random_batch(config, batch=1, seq=4)
parameters = inspect.signature(liger_dspine.apply_liger_kernel_to_deepseek_v3).parameters
options = [name for name, p in parameters.items() if isinstance(p.default, bool)]
messages = {"cuda": torch.cuda.is_available()}
for enabled in options:  # one kernel family at a time
    # these need another option on
    if enabled in ("fused_experts", "grouped_experts", "vocab_chunked_lce", "recompute_attention", "fp8"):
        continue
    model = build_model(config)
    liger_dspine.apply_liger_kernel_to_instance(model, **{name: name == enabled for name in options})
    try:
        model(input_ids, labels=labels)
        messages[enabled] = None
    except RuntimeError as error:
        messages[enabled] = str(error)
# without a dense layer the routed experts run before any other SwiGLU module
model = build_model(tiny_deepseek_v3_config(first_k_dense_replace=0))
liger_dspine.apply_liger_kernel_to_instance(
    model, **{name: name in ("swiglu", "fused_experts") for name in options}
)
try:
    model(input_ids)
    messages["routed_experts"] = None
except RuntimeError as error:
    messages["routed_experts"] = str(error)
print(json.dumps(messages))
"""


def test_cpu_tensor_without_interpreter_fails_with_a_clear_message():
    env = {k: v for k, v in os.environ.items() if k not in ("LIGER_DSPINE_INTERPRET", "TRITON_INTERPRET")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    test_dir = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", NO_INTERPRETER_SCRIPT, str(test_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    messages = json.loads(result.stdout.strip().splitlines()[-1])
    assert messages.pop("cuda") is False
    assert {"rms_norm", "swiglu", "routed_experts", "fused_linear_cross_entropy", "cross_entropy"} <= set(messages)
    assert "LigerFusedExperts" in messages["routed_experts"]
    for name, message in messages.items():
        assert message is not None, f"{name}: no error on a CPU tensor without the interpreter"
        assert "LIGER_DSPINE_INTERPRET" in message, f"{name}: {message}"
        assert "active drivers" not in message, f"{name}: {message}"
