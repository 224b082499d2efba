"""The model-type registry, the strict generic entry points, and the hook into liger-kernel's own table."""

import inspect

import pytest
import torch
from liger_kernel.transformers import AutoLigerKernelForCausalLM
from liger_kernel.transformers import monkey_patch as liger_monkey_patch
from transformers import DeepseekV3ForCausalLM
from transformers import LlamaConfig
from transformers import LlamaForCausalLM

from liger_dspine import MODEL_TYPE_TO_APPLY_LIGER_FN
from liger_dspine import apply_liger_kernel
from liger_dspine import apply_liger_kernel_to_deepseek_v3
from liger_dspine import apply_liger_kernel_to_dspine
from liger_dspine import apply_liger_kernel_to_instance
from liger_dspine import register_with_liger
from liger_dspine.models.deepseek_v3.router import LigerDeepseekV3TopkRouter
from liger_dspine.modules.causal_lm_forward import lce_forward
from liger_dspine.modules.experts import LigerFusedExperts
from liger_dspine.modules.grouped_experts import LigerGroupedExperts
from liger_dspine.modules.rms_norm import LigerRMSNorm
from liger_dspine.modules.swiglu import LigerSwiGLUMLP
from liger_dspine.patching import replacement_of
from tiny_models import build_model
from tiny_models import changed_modeling_globals
from tiny_models import class_patches_reverted
from tiny_models import module_types
from tiny_models import snapshot_modeling_globals
from tiny_models import tiny_deepseek_v3_config

pytestmark = pytest.mark.matrix  # runs against every transformers version of the matrix

LIGER_TABLE = liger_monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN
LIGER_DEEPSEEK_V3_FN = LIGER_TABLE["deepseek_v3"]


@pytest.fixture
def class_level():
    with class_patches_reverted() as before:
        yield before


@pytest.fixture
def liger_table():
    """liger-kernel's dispatch table, restored entry by entry (same objects) afterwards."""
    saved = dict(LIGER_TABLE)
    yield LIGER_TABLE
    LIGER_TABLE.clear()
    LIGER_TABLE.update(saved)
    assert LIGER_TABLE["deepseek_v3"] is LIGER_DEEPSEEK_V3_FN


def tiny_llama():
    config = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    return LlamaForCausalLM(config)


def assert_liger_dspine_modules(model) -> None:
    """The model was patched by this package (not by liger-kernel's own deepseek_v3 function)."""
    types = list(module_types(model).values())
    assert types.count(LigerRMSNorm) == 9
    assert types.count(LigerSwiGLUMLP) == 2
    assert types.count(LigerDeepseekV3TopkRouter) == 1
    assert LigerFusedExperts not in types and types.count(LigerGroupedExperts) == 1  # the default routed experts
    assert not [t for t in types if t.__module__.startswith("liger_kernel")]


OURS = [
    "axk1",
    "deepseek_v2",
    "deepseek_v3",
    "deepseek_v32",
    "deepseek_v4",
    "dots1",
    "dspine",
    "ergo",
    "glm4_moe",
    "glm4_moe_lite",
    "glm_moe_dsa",
    "kimi_k25",
    "minicpm3",
    "minicpm5_moe",
    "mistral3",
    "mistral4",
    "param2moe",
    "sarvam_mla",
    "youtu",
]
LIGER_KERNEL_HAS = ["deepseek_v2", "deepseek_v3", "deepseek_v4"]  # the entries liger-kernel's own table has


def test_table_serves_deepseek_v3_its_family_and_dspine():
    import liger_dspine

    assert sorted(MODEL_TYPE_TO_APPLY_LIGER_FN) == OURS
    assert MODEL_TYPE_TO_APPLY_LIGER_FN["dspine"] is apply_liger_kernel_to_dspine
    # sarvam_mla's config builds DeepseekV3ForCausalLM: DeepSeek-V3's function serves it
    assert MODEL_TYPE_TO_APPLY_LIGER_FN["sarvam_mla"] is apply_liger_kernel_to_deepseek_v3
    for model_type in set(OURS) - {"sarvam_mla"}:
        assert MODEL_TYPE_TO_APPLY_LIGER_FN[model_type] is getattr(liger_dspine, f"apply_liger_kernel_to_{model_type}")


def test_sarvam_mla_builds_a_deepseek_v3_model_that_the_table_patches():
    from transformers import AutoConfig
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if "sarvam_mla" not in CONFIG_MAPPING_NAMES:
        pytest.skip("this transformers has no sarvam_mla")
    values = {k: v for k, v in tiny_deepseek_v3_config().to_diff_dict().items() if k != "model_type"}
    config = AutoConfig.for_model("sarvam_mla", **values)
    model = AutoModelForCausalLM.from_config(config)
    assert type(model) is DeepseekV3ForCausalLM and model.config.model_type == "sarvam_mla"
    report = apply_liger_kernel_to_instance(model)
    assert report.model_type == "deepseek_v3"
    assert_liger_dspine_modules(model)


@pytest.mark.parametrize("model_type", ["longcat_flash", "glm4v_moe", "kimi_linear", "hy_v4"])
def test_unsupported_family_members_are_named_as_such(model_type):
    with pytest.raises(
        ValueError, match=f"liger-dspine: '{model_type}' is built partly from DeepSeek-V3's classes, but"
    ):
        apply_liger_kernel(model_type)


def test_register_with_liger_replaces_liger_entry(liger_table):
    others = {k: v for k, v in liger_table.items() if k not in OURS}

    result = register_with_liger()

    assert sorted(result["registered"]) == OURS and result["left_alone"] == []
    assert liger_table["deepseek_v3"] is apply_liger_kernel_to_deepseek_v3
    assert liger_table["dspine"] is apply_liger_kernel_to_dspine
    assert {k: v for k, v in liger_table.items() if k not in OURS} == others
    # registering again is harmless
    again = register_with_liger(override=False)
    assert sorted(again["registered"]) == OURS and again["left_alone"] == []
    assert liger_table["deepseek_v3"] is apply_liger_kernel_to_deepseek_v3


def test_register_without_override_keeps_liger_entry(liger_table):
    result = register_with_liger(override=False)

    # liger-kernel has no dspine entry and few family entries: they are added; its own entries are kept
    assert sorted(result["registered"]) == sorted(set(OURS) - set(LIGER_KERNEL_HAS))
    assert sorted(result["left_alone"]) == LIGER_KERNEL_HAS
    assert liger_table["deepseek_v3"] is LIGER_DEEPSEEK_V3_FN


def test_register_without_override_adds_a_missing_entry(liger_table):
    del liger_table["deepseek_v3"]

    result = register_with_liger(override=False)
    assert sorted(result["registered"]) == sorted(set(OURS) - {"deepseek_v2", "deepseek_v4"})
    assert sorted(result["left_alone"]) == ["deepseek_v2", "deepseek_v4"]
    assert liger_table["deepseek_v3"] is apply_liger_kernel_to_deepseek_v3


def test_liger_auto_model_builds_our_modules_once_registered(liger_table, class_level):
    register_with_liger()

    model = AutoLigerKernelForCausalLM.from_config(tiny_deepseek_v3_config())

    assert type(model) is DeepseekV3ForCausalLM
    assert_liger_dspine_modules(model)
    assert replacement_of(DeepseekV3ForCausalLM.forward) is lce_forward


def test_liger_instance_hook_patches_only_that_instance(liger_table):
    """The path of ``transformers.Trainer(use_liger_kernel=True)`` for a built model."""
    register_with_liger()
    model, other = build_model(tiny_deepseek_v3_config()), build_model(tiny_deepseek_v3_config())
    other_types = module_types(other)
    before = snapshot_modeling_globals()

    liger_monkey_patch._apply_liger_kernel_to_instance(model=model)

    assert_liger_dspine_modules(model)
    assert model.forward.__func__ is lce_forward
    assert module_types(other) == other_types
    assert changed_modeling_globals(before) == []


def test_apply_liger_kernel_patches_classes(class_level):
    report = apply_liger_kernel("deepseek_v3", swiglu=False)

    assert report.scope == "class"
    model = build_model(tiny_deepseek_v3_config())
    types = list(module_types(model).values())
    assert types.count(LigerRMSNorm) == 9 and LigerSwiGLUMLP not in types and LigerFusedExperts not in types
    assert LigerGroupedExperts not in types  # routed experts follow swiglu


def test_apply_liger_kernel_to_instance_patches_the_model():
    model = build_model(tiny_deepseek_v3_config())
    before = snapshot_modeling_globals()

    report = apply_liger_kernel_to_instance(model, rms_norm=False)

    assert report.scope == "instance"
    types = list(module_types(model).values())
    assert LigerRMSNorm not in types and types.count(LigerSwiGLUMLP) == 2
    assert changed_modeling_globals(before) == []


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: apply_liger_kernel("llama"), ValueError, r"no patch for model type 'llama'; supported: .*deepseek_v3"),
        (lambda: apply_liger_kernel("deepseek_v3", not_a_flag=True), TypeError, "not_a_flag"),
        (lambda: apply_liger_kernel("deepseek_v3", model=torch.nn.Linear(2, 2)), TypeError, "instance"),
        (
            lambda: apply_liger_kernel_to_instance(build_model(tiny_deepseek_v3_config()), bogus=1),
            TypeError,
            "bogus",
        ),
        (
            lambda: apply_liger_kernel_to_instance(tiny_llama()),
            ValueError,
            r"no patch for model type 'llama'; supported: .*deepseek_v3",
        ),
        (lambda: apply_liger_kernel_to_instance(torch.nn.Linear(2, 2)), ValueError, "config.model_type"),
    ],
    ids=["unknown_type", "unknown_option", "model_to_class_patch", "unknown_instance_option", "llama", "no_config"],
)
def test_refused_calls_change_nothing(call, error, message):
    before = snapshot_modeling_globals()

    with pytest.raises(error, match=message):
        call()

    assert changed_modeling_globals(before) == []


def test_unknown_option_error_lists_accepted_options():
    with pytest.raises(TypeError) as raised:
        apply_liger_kernel("deepseek_v3", not_a_flag=True, swiglu=False)
    message = str(raised.value)
    assert "'not_a_flag'" in message and "'swiglu'" not in message.split("accepts")[0]
    for option in ("rope", "cross_entropy", "fused_linear_cross_entropy", "rms_norm", "swiglu"):
        assert option in message.split("accepts")[1]


@pytest.mark.parametrize("model_type", sorted(set(MODEL_TYPE_TO_APPLY_LIGER_FN) - {"sarvam_mla"}))
def test_every_apply_function_checks_its_options_before_patching(model_type):
    apply = MODEL_TYPE_TO_APPLY_LIGER_FN[model_type]
    params = inspect.signature(apply).parameters
    assert list(params)[:1] != ["args"]  # the wrapper keeps the function's own signature for liger-kernel's dispatch
    before = snapshot_modeling_globals()
    with pytest.raises(TypeError, match=r"got unknown option\(s\) 'not_a_flag'; it accepts: .*rms_norm"):
        apply(not_a_flag=True)
    with pytest.raises(TypeError, match="option rms_norm must be True or False, got 'false'"):
        apply(rms_norm="false")
    assert changed_modeling_globals(before) == []
