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


def check_activation(config, what: str) -> None:
    """``check_silu`` of ``config.hidden_act``, naming that field."""
    activation = getattr(config, "hidden_act", None)
    if activation not in SILU_ACTIVATIONS:
        raise ValueError(f"liger-dspine: {what} fuses SiLU only; config.hidden_act is {activation!r}")


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


def runs_plain_linear(module: nn.Module) -> bool:
    """Calling ``module`` is ``F.linear`` with its weight and bias: an ``nn.Linear`` with its own forward, no hooks."""
    hooks = (
        module._forward_pre_hooks,
        module._forward_hooks,
        module._backward_pre_hooks,
        module._backward_hooks,
    )
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward and not any(hooks)
