"""Model type -> apply function, lookups by model or config, and the hook into liger-kernel's own table."""

import logging

from liger_dspine.models.axk1.apply import apply_liger_kernel_to_axk1
from liger_dspine.models.deepseek_v2.apply import apply_liger_kernel_to_deepseek_v2
from liger_dspine.models.deepseek_v3.apply import apply_liger_kernel_to_deepseek_v3
from liger_dspine.models.deepseek_v4.apply import apply_liger_kernel_to_deepseek_v4
from liger_dspine.models.deepseek_v32.apply import apply_liger_kernel_to_deepseek_v32
from liger_dspine.models.dots1.apply import apply_liger_kernel_to_dots1
from liger_dspine.models.dspine.apply import apply_liger_kernel_to_dspine
from liger_dspine.models.ergo.apply import apply_liger_kernel_to_ergo
from liger_dspine.models.glm4_moe.apply import apply_liger_kernel_to_glm4_moe
from liger_dspine.models.glm4_moe_lite.apply import apply_liger_kernel_to_glm4_moe_lite
from liger_dspine.models.glm_moe_dsa.apply import apply_liger_kernel_to_glm_moe_dsa
from liger_dspine.models.kimi_k25.apply import apply_liger_kernel_to_kimi_k25
from liger_dspine.models.minicpm3.apply import apply_liger_kernel_to_minicpm3
from liger_dspine.models.minicpm5_moe.apply import apply_liger_kernel_to_minicpm5_moe
from liger_dspine.models.mistral3.apply import apply_liger_kernel_to_mistral3
from liger_dspine.models.mistral4.apply import apply_liger_kernel_to_mistral4
from liger_dspine.models.param2moe.apply import apply_liger_kernel_to_param2moe
from liger_dspine.models.youtu.apply import apply_liger_kernel_to_youtu
from liger_dspine.patching import check_options

logger = logging.getLogger(__name__)

MODEL_TYPE_TO_APPLY_LIGER_FN = {
    "deepseek_v3": apply_liger_kernel_to_deepseek_v3,
    "dspine": apply_liger_kernel_to_dspine,
    # models whose modeling files copy DeepSeek-V3's classes (models/deepseek_v3/family.py)
    "axk1": apply_liger_kernel_to_axk1,
    "deepseek_v32": apply_liger_kernel_to_deepseek_v32,
    "dots1": apply_liger_kernel_to_dots1,
    "glm4_moe": apply_liger_kernel_to_glm4_moe,
    "glm4_moe_lite": apply_liger_kernel_to_glm4_moe_lite,
    "glm_moe_dsa": apply_liger_kernel_to_glm_moe_dsa,
    "minicpm5_moe": apply_liger_kernel_to_minicpm5_moe,
    # its config builds Glm4MoeForCausalLM: GLM-4.5's swaps, reported under its own model type
    "param2moe": apply_liger_kernel_to_param2moe,
    # clamped SwiGLU experts, norms and loss; attention, routers and hyper-connections native (models/deepseek_v4)
    "deepseek_v4": apply_liger_kernel_to_deepseek_v4,
    # DeepSeek-V3's MoE block over modules of its own: norms, router and loss; ReLU² MLPs and experts native
    "ergo": apply_liger_kernel_to_ergo,
    # a multimodal model whose text model is DeepSeek-V3's (keyed by the top-level config's model type)
    "kimi_k25": apply_liger_kernel_to_kimi_k25,
    "mistral3": apply_liger_kernel_to_mistral3,
    # its config builds DeepseekV3ForCausalLM (transformers has no modeling file for it)
    "sarvam_mla": apply_liger_kernel_to_deepseek_v3,
    "youtu": apply_liger_kernel_to_youtu,
    # MLA models with a softmax router or none (models/deepseek_v2/spec.py)
    "deepseek_v2": apply_liger_kernel_to_deepseek_v2,
    "minicpm3": apply_liger_kernel_to_minicpm3,
    "mistral4": apply_liger_kernel_to_mistral4,
}

# Model types built partly from DeepSeek-V3's classes that no patch here serves: a lookup names them as such.
UNSUPPORTED_FAMILY_MEMBERS = (
    "axk2",
    "bailing_hybrid",
    "beam",
    "dots3_note",
    "exaone_moe",
    "glm4v_moe",
    "glm5_next",
    "hy_v3",
    "hy_v4",
    "kimi_linear",
    "kolibri1",
    "longcat_flash",
    "mimo_v2_flash",
    "mistral_large4",
    "muse_spark",
)


def apply_fn_for(model_type: str):
    """The apply function of ``model_type``; a ValueError listing the supported types when there is none."""
    try:
        return MODEL_TYPE_TO_APPLY_LIGER_FN[model_type]
    except KeyError:
        supported = ", ".join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))
        if model_type in UNSUPPORTED_FAMILY_MEMBERS:
            raise ValueError(
                f"liger-dspine: {model_type!r} is built partly from DeepSeek-V3's classes, but it is an unsupported "
                f"member of that family: its modules differ where the kernels would compute something else. "
                f"Supported: {supported}"
            ) from None
        raise ValueError(f"liger-dspine: no patch for model type {model_type!r}; supported: {supported}") from None


def apply_liger_kernel(model_type: str, **options):
    """Class-level patch for ``model_type``; an option the patch function does not take is a TypeError."""
    fn = apply_fn_for(model_type)
    check_options(fn, options)
    if "model" in options:
        raise TypeError(
            "liger-dspine: apply_liger_kernel() patches classes; use apply_liger_kernel_to_instance(model) for a model"
        )
    return fn(**options)


def model_type_for_config(config) -> str | None:
    """``config.model_type``, except for a DSpine drafter's config, which is "dspine" also in SpecForge's layout
    (``model_type "qwen3"`` marked by ``architectures ["DSpineDraftModel"]`` or a ``dspine_config``); a plain Qwen3
    config stays "qwen3"."""
    model_type = getattr(config, "model_type", None)
    marked = list(getattr(config, "architectures", None) or []) == ["DSpineDraftModel"]
    if model_type in ("qwen3", None) and (marked or getattr(config, "dspine_config", None) is not None):
        return "dspine"
    return model_type


def model_type_of(model) -> str:
    model_type = model_type_for_config(getattr(model, "config", None))
    if model_type is None:
        raise ValueError(f"liger-dspine: {type(model).__name__} has no config.model_type to choose a patch by")
    return model_type


def apply_liger_kernel_to_instance(model, **options):
    """Patch one built model, chosen by ``model.config.model_type``."""
    fn = apply_fn_for(model_type_of(model))
    check_options(fn, options)
    if "model" in options:
        raise TypeError(
            "liger-dspine: apply_liger_kernel_to_instance() takes the model as its first argument, not as an option"
        )
    return fn(model=model, **options)


def register_with_liger(override: bool = True) -> dict[str, list[str]]:
    """Put this package's apply functions into liger-kernel's ``MODEL_TYPE_TO_APPLY_LIGER_FN``.

    liger-kernel's ``AutoLigerKernelForCausalLM`` and ``transformers.Trainer(use_liger_kernel=True)`` look patches
    up in that table by ``config.model_type``. ``override=True`` replaces entries liger-kernel already has
    (it has ``deepseek_v3``); ``override=False`` only adds missing ones.

    Returns ``{"registered": [...], "left_alone": [...]}``: model types now served by this package, and those
    whose liger-kernel entry was kept.
    """
    from liger_kernel.transformers import monkey_patch

    table = monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN
    registered, left_alone = [], []
    for model_type, fn in MODEL_TYPE_TO_APPLY_LIGER_FN.items():
        current = table.get(model_type)
        if current is not None and current is not fn and not override:
            left_alone.append(model_type)
            continue
        table[model_type] = fn
        registered.append(model_type)
    logger.info("liger-dspine registered %s with liger-kernel; left alone: %s", registered, left_alone)
    return {"registered": registered, "left_alone": left_alone}
