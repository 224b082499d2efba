"""A bias-free ``nn.Linear`` called with its GEMMs in FP8 (:func:`~liger_dspine.ops.fp8_linear.fp8_linear`), as the
module would run: inside its own hooks where a sharding engine (FSDP2, DeepSpeed ZeRO-3) gathers its weight around
the call. Anything else (a bias, adapters, a forward of its own, tensor-parallel DTensor weights, other hooks) is
refused: its numbers would not be the module's."""

import torch
from torch import nn

from liger_dspine.modules.config_reading import runs_plain_linear
from liger_dspine.modules.parallel_state import call_through_hooks
from liger_dspine.modules.parallel_state import gathered_by_hooks
from liger_dspine.modules.parallel_state import is_dtensor
from liger_dspine.ops.fp8_linear import check_multiple_of_16
from liger_dspine.ops.fp8_linear import fp8_linear


def check_fp8_projection(linear: nn.Module, name: str) -> None:
    """A ValueError naming ``name`` unless ``linear`` is a bias-free ``nn.Linear`` run as is, or gathered by a
    sharding engine's hooks."""
    plain = isinstance(linear, nn.Linear) and type(linear).forward is nn.Linear.forward
    if not plain or "forward" in vars(linear):
        raise ValueError(
            f"liger-dspine: fp8=True runs {name} as a plain nn.Linear; this one is {type(linear).__name__} with a "
            "forward of its own (an adapter or a quantised layer): pass fp8=False"
        )
    if linear.bias is not None:
        raise ValueError(f"liger-dspine: fp8=True has no projection biases; {name} has one: pass fp8=False")
    if gathered_by_hooks(linear):  # its weight is whole inside the call
        return
    if not runs_plain_linear(linear) or is_dtensor(linear.weight):
        raise ValueError(
            f"liger-dspine: fp8=True cannot run {name} under tensor parallelism or hooks other than FSDP2's / "
            "DeepSpeed ZeRO-3's: pass fp8=False"
        )


def check_fp8_linears(owner: str, module: nn.Module, names: tuple[str, ...]) -> None:
    """At patch time, a ValueError for what ``fp8=True`` cannot run among ``module``'s projections ``names`` (those it
    has): a bias, or a dim that is not a multiple of 16 (the FP8 GEMMs' requirement), named with its projection; so
    that the patch refuses the model before changing it, not at its first forward."""
    dims = {}
    for name in names:
        linear = getattr(module, name, None)
        if not isinstance(linear, nn.Linear):
            continue  # absent, or not a plain linear: the forward names it (check_fp8_projection)
        if linear.bias is not None:
            raise ValueError(
                f"liger-dspine: fp8=True has no projection biases; this {owner}'s {name} has one: pass fp8=False"
            )
        dims.update({f"{name}.{dim}": getattr(linear, dim) for dim in ("in_features", "out_features")})
    check_multiple_of_16(f"fp8=True on this {owner}", "pass fp8=False", **dims)


def call_as_fp8_projection(linear: nn.Module, name: str, function, *args):
    """``function(*args)`` in place of ``linear``'s call, once :func:`check_fp8_projection` accepts it: inside the
    module's hooks where a sharding engine gathers its weight, else directly. ``function`` reads ``linear.weight``."""
    check_fp8_projection(linear, name)
    if gathered_by_hooks(linear):
        return call_through_hooks(linear, function, *args)
    return function(*args)


def fp8_projection(linear: nn.Module, x: torch.Tensor, name: str) -> torch.Tensor:
    """``linear(x)`` with FP8 GEMMs (``linear`` a bias-free ``nn.Linear`` called ``name``)."""
    return call_as_fp8_projection(linear, name, lambda rows: fp8_linear(rows, linear.weight), x)
