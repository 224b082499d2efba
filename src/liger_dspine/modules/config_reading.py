"""What the Liger modules read from a model and its config: the activation they fuse, the routed experts' sizes,
and whether a projection is a plain Linear whose weight may be used directly.

Imports no Triton, so modules without kernels of their own (the grouped-GEMM experts) can use it too.
"""

from torch import nn

# activation names transformers' ACT2FN maps to SiLU
SILU_ACTIVATIONS = ("silu", "swish")


def check_silu(activation, what: str) -> None:
    """A ValueError naming the activation unless it is SiLU: ``what`` computes ``silu(gate) * up`` only."""
    if activation not in SILU_ACTIVATIONS:
        raise ValueError(f"liger-dspine: {what} computes silu(gate) * up only; the activation is {activation!r}")


def unfused_activation_reason(config, module: nn.Module | None = None) -> str | None:
    """Why a SiLU-fusing kernel would not compute a SwiGLU MLP or experts module: ``config.hidden_act``, or the
    module's own ``act_fn``, is another activation (GELU in transformers' tiny test configs); None otherwise (a
    config naming no activation is left to ``check_activation``)."""
    activation = getattr(config, "hidden_act", None)
    if activation is not None and activation not in SILU_ACTIVATIONS:
        return f"config.hidden_act is {activation!r}, and the kernel fuses SiLU only"
    act_fn = None if module is None else getattr(module, "act_fn", None)
    if act_fn is not None and not is_silu_module(act_fn):
        return f"its act_fn is {type(act_fn).__name__}, and the kernel fuses SiLU only"
    return None


def check_activation(config, what: str) -> None:
    """``check_silu`` of ``config.hidden_act``, naming that field."""
    activation = getattr(config, "hidden_act", None)
    if activation not in SILU_ACTIVATIONS:
        raise ValueError(f"liger-dspine: {what} fuses SiLU only; config.hidden_act is {activation!r}")


# fields that clamp a SwiGLU's gate and up projections (DeepSeek-V4, GLM-5.3, HY-V4, MiniMax-M3, gpt-oss)
CLAMP_FIELDS = ("swiglu_limit", "limit")


# The clamped SwiGLUs the Liger modules reproduce: silu(gate.clamp(max=limit)) * up.clamp(-limit, limit), with
# ``config.swiglu_limit`` of these model types, computed by these native methods (module and qualified name).
CLAMPED_SWIGLU_MODEL_TYPES = ("deepseek_v4",)
CLAMPED_SWIGLU_METHODS = {
    "_apply_gate": ("transformers.models.deepseek_v4.", "DeepseekV4Experts._apply_gate"),
    "forward": ("transformers.models.deepseek_v4.", "DeepseekV4MLP.forward"),
}


def _clamps_as_deepseek_v4(config, module: nn.Module | None, method: str) -> bool:
    """Whether the only clamp fields are DeepSeek-V4's (``config.swiglu_limit``, the module's ``limit``) and the
    module's class computes the clamp with DeepSeek-V4's own ``method``."""
    if getattr(config, "model_type", None) not in CLAMPED_SWIGLU_MODEL_TYPES or getattr(config, "limit", None):
        return False
    if module is None:
        return getattr(config, "swiglu_limit", None) is not None
    if getattr(module, "swiglu_limit", None) is not None or getattr(module, "limit", None) is None:
        return False
    prefix, qualname = CLAMPED_SWIGLU_METHODS[method]
    function = getattr(type(module), method, None)
    return getattr(function, "__qualname__", None) == qualname and function.__module__.startswith(prefix)


def swiglu_limit(what: str, config, module: nn.Module | None = None, method: str = "forward") -> float | None:
    """The limit a Liger SwiGLU must clamp gate and up to, None for an unclamped one; ``check_plain_swiglu``'s
    ValueError for anything else. A module's own ``limit`` is the one its native ``method`` uses; without a module
    (construction) ``config.swiglu_limit``."""
    if _clamps_as_deepseek_v4(config, module, method):
        check_activation(config, what)
        _check_act_fn(what, module)
        return float(config.swiglu_limit if module is None else module.limit)
    check_plain_swiglu(what, config, module)
    return None


def is_silu_module(act_fn) -> bool:
    return isinstance(act_fn, nn.SiLU) or type(act_fn).__name__ == "SiLUActivation"


def check_plain_swiglu(what: str, config, module: nn.Module | None = None) -> None:
    """A ValueError unless ``silu(gate) * up`` is what the config and the module compute: ``config.hidden_act`` is
    SiLU (when a config is given), the module's ``act_fn`` (if any) is SiLU, and neither clamps the projections."""
    if config is not None:
        check_activation(config, what)
    for holder, label in ((config, "config"), (module, "this module")):
        for name in CLAMP_FIELDS:
            value = None if holder is None else getattr(holder, name, None)
            if value is not None:
                raise ValueError(
                    f"liger-dspine: {what} computes silu(gate) * up without a clamp; {label} has {name}={value!r} "
                    "(a clamped SwiGLU): its numbers would change"
                )
    _check_act_fn(what, module)


def _check_act_fn(what: str, module: nn.Module | None) -> None:
    act_fn = None if module is None else getattr(module, "act_fn", None)
    if act_fn is not None and not is_silu_module(act_fn):
        raise ValueError(
            f"liger-dspine: {what} computes silu(gate) * up; this module's act_fn is {type(act_fn).__name__}, "
            "which would be dropped"
        )


def expert_sizes(config) -> tuple[int, int, int]:
    """(routed experts E, hidden H, expert width I) of a MoE config."""
    for name in ("n_routed_experts", "num_local_experts", "num_experts"):
        num_experts = getattr(config, name, None)
        if num_experts is not None:
            break
    else:
        raise ValueError("liger-dspine: the config names no expert count (n_routed_experts / num_local_experts)")
    intermediate = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    return num_experts, config.hidden_size, intermediate


def has_module_hooks(module: nn.Module) -> bool:
    """Whether ``module`` carries a forward or backward hook (pre-hooks included) of its own."""
    hooks = (
        module._forward_pre_hooks,
        module._forward_hooks,
        module._backward_pre_hooks,
        module._backward_hooks,
    )
    return any(hooks)


def runs_plain_linear(module: nn.Module) -> bool:
    """Calling ``module`` is ``F.linear`` with its weight and bias: an ``nn.Linear`` with its own forward, no hooks."""
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward and not has_module_hooks(module)


# transformers' experts implementations the patched experts stand in for: the default grouped GEMMs, and the
# reference loop (transformers' own fallback where grouped GEMMs cannot run); both compute the same products
_EXPERTS_IMPLEMENTATIONS_TAKEN = (None, "eager", "grouped_mm")


def check_experts_implementation(module, what: str) -> None:
    """A ValueError when the model selects another of transformers' experts implementations
    (``set_experts_implementation`` / ``experts_implementation=``, read from ``config._experts_implementation``),
    which the patched experts would otherwise ignore."""
    chosen = getattr(getattr(module, "config", None), "_experts_implementation", None)
    if chosen not in _EXPERTS_IMPLEMENTATIONS_TAKEN:
        raise ValueError(
            f"liger-dspine: the model selects transformers' experts_implementation={chosen!r}, but its experts are "
            f"{what}, which run this package's kernels: pass grouped_experts=False (and fused_experts=False) to the "
            "patch to use transformers' implementation"
        )
