"""How a module's weight is laid out across ranks inside the forward, for the fused kernels that read weights
without calling the module that owns them.

``lm_head``, for the fused loss:

- whole: a plain tensor (one process, DDP, DeepSpeed ZeRO-1/2, or FSDP2 with the head in its parent's group, which
  FSDP has gathered by the time the loss runs);
- vocabulary-parallel: tensor parallelism's column-wise head, a DTensor sharded over the vocabulary on a 1-D mesh;
  the fused loss runs on the local rows (``ops/vocab_parallel_cross_entropy.py``) with the mesh's collectives;
- anything else (FSDP2's own ``fully_shard(model.lm_head)``, a 2-D layout): the fused loss cannot read it, so the
  loss is computed from the head's logits, by calling the head, which gathers what it needs.

A row-wise (input-sharded) linear of tensor parallelism, for the fused SwiGLU down projection: the kernel runs on the
local columns and its partial output is summed over the mesh, as the plan's own output step does.
"""

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class VocabShard:
    """This rank's rows [vocab_start, vocab_start + local_weight.shape[0]) of a [vocab_size, H] head."""

    local_weight: torch.Tensor
    vocab_start: int
    vocab_size: int
    group: object


def _dtensor_class():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed support
        return None
    return DTensor


def _is_fsdp_module(module: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(module, FSDPModule)


def vocab_shard(weight: torch.Tensor) -> VocabShard | None:
    """The local rows of a weight sharded over its first dimension on a 1-D mesh, else None."""
    DTensor = _dtensor_class()
    if DTensor is None or not isinstance(weight, DTensor):
        return None
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = weight.device_mesh
    if mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        return None
    _, offset = compute_local_shape_and_global_offset(weight.shape, mesh, weight.placements)
    return VocabShard(weight.to_local(), int(offset[0]), int(weight.shape[0]), mesh.get_group())


def sharded_head_reason(head: nn.Module) -> str | None:
    """Why the fused loss cannot read ``head.weight`` as it stands inside the forward, or None: whole, gathered by
    the head's own sharding hooks around a call (FSDP2's ``fully_shard(model.lm_head)``, DeepSpeed ZeRO-3), or
    vocabulary-parallel under tensor parallelism."""
    DTensor = _dtensor_class()
    weight = head.weight
    if DTensor is None or not isinstance(weight, DTensor) or gathered_by_hooks(head) or tensor_parallel_head(head):
        return None
    return (
        f"lm_head.weight is a DTensor with placements {tuple(weight.placements)} on a {weight.device_mesh.ndim}-D mesh"
    )


def tensor_parallel_head(head: nn.Module) -> bool:
    """Whether ``head`` is tensor parallelism's vocabulary-sharded head, whose forward, installed by the plan, only
    moves the input and output between layouts: its weight is sharded over the vocabulary on a 1-D mesh, or on the
    innermost dimension of a 2-D one (FSDP2 outside, gathered before the loss reads it), and transformers marks the
    module as one its plans installed a forward on."""
    DTensor = _dtensor_class()
    weight = head.weight
    if DTensor is None or not isinstance(weight, DTensor):
        return False
    from torch.distributed.tensor import Shard

    vocabulary_sharded = tuple(weight.placements)[-1:] == (Shard(0),)
    return vocabulary_sharded and (getattr(head, "_is_hooked", False) or not _is_fsdp_module(head))


def rowwise_shard(linear: nn.Module):
    """(local weight [H, I / tp], mesh) of tensor parallelism's row-wise linear without bias, else None."""
    DTensor = _dtensor_class()
    weight = getattr(linear, "weight", None)
    if DTensor is None or not isinstance(weight, DTensor) or _is_fsdp_module(linear):
        return None
    from torch.distributed.tensor import Shard

    if weight.device_mesh.ndim != 1 or tuple(weight.placements) not in ((Shard(1),), (Shard(-1),)):
        return None
    if getattr(linear, "bias", None) is not None:
        return None
    return weight.to_local(), weight.device_mesh


def sum_partial_over(output: torch.Tensor, mesh) -> torch.Tensor:
    """A rank's partial sum made whole on every rank of ``mesh`` (an all-reduce whose backward passes the gradient
    through), as tensor parallelism's row-wise output step does."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor import Replicate

    partial = DTensor.from_local(output, mesh, [Partial()], run_check=False)
    return partial.redistribute(mesh, [Replicate()]).to_local()


def is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor (sharded or replicated over a device mesh)."""
    DTensor = _dtensor_class()
    return DTensor is not None and isinstance(tensor, DTensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, else the tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def _expert_dispatchers(forward) -> list:
    """The objects behind an expert-parallel forward installed on an experts module that call the experts' own
    forward (transformers' ``EPImplementation``s, which keep it as ``experts_forward``), found through the installed
    forward's closure; empty when there are none."""
    found, seen = [], set()
    pending = [cell.cell_contents for cell in (getattr(forward, "__closure__", None) or ()) if _filled(cell)]
    while pending:
        item = pending.pop()
        if id(item) in seen or isinstance(item, (nn.Module, torch.Tensor, str, int, float, type(None))):
            continue
        seen.add(id(item))
        if callable(getattr(item, "experts_forward", None)):
            found.append(item)
            pending.extend(value for value in vars(item).values() if hasattr(value, "experts_forward"))
    return found


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


def expert_parallel_dispatch(module: nn.Module) -> str:
    """ "none" for experts without an expert-parallel forward set on the module; "rebindable" when that forward
    reaches the experts through dispatchers this package can point at another forward; else "opaque"."""
    installed = vars(module).get("forward")
    if installed is None or not getattr(module, "_is_expert_parallel", False):
        return "none"
    return "rebindable" if _expert_dispatchers(installed) else "opaque"


def rebind_expert_forward(module: nn.Module, forward) -> int:
    """Point the expert-parallel dispatch installed on ``module`` at ``forward`` (bound to the module); returns how
    many dispatchers now call it."""
    dispatchers = _expert_dispatchers(vars(module)["forward"])
    for dispatcher in dispatchers:
        dispatcher.experts_forward = forward
    return len(dispatchers)


# Packages whose module hooks only gather, partition or move parameters and inputs around a module's own forward:
# FSDP2, DeepSpeed ZeRO-3 (its hooks, some wrapped in its NVTX ranges).
_PARAMETER_HOOK_PACKAGES = (
    "torch.distributed.fsdp.",
    "torch.distributed._composable.fsdp.",
    "deepspeed.runtime.zero.",
    "deepspeed.utils.nvtx",
)


def _hook_package(hook) -> str:
    target = getattr(hook, "func", hook)  # functools.partial
    owner = getattr(target, "__self__", None)
    return getattr(owner, "__module__", None) or getattr(target, "__module__", None) or ""


def parameter_hooks_only(module: nn.Module) -> bool:
    """Whether every forward hook of ``module`` belongs to a sharding engine that only gathers its parameters (FSDP2,
    DeepSpeed ZeRO-3), so reading the gathered weight computes what calling the module would."""
    hooks = list(module._forward_pre_hooks.values()) + list(module._forward_hooks.values())
    return all(_hook_package(hook).startswith(_PARAMETER_HOOK_PACKAGES) for hook in hooks)


def gathered_by_hooks(module: nn.Module) -> bool:
    """Whether ``module`` has forward hooks, all of a sharding engine's, that gather its weight around a call."""
    return bool(module._forward_pre_hooks or module._forward_hooks) and parameter_hooks_only(module)


def call_through_hooks(module: nn.Module, function, *args):
    """``function(*args)`` run as ``module``'s forward for one call, inside the module's own hooks: a sharding engine
    (FSDP2, DeepSpeed ZeRO-3) gathers the module's parameters before it, releases them after, and gathers them again
    for, and reduces their gradients after, the backward of what it returns. ``function`` reads the parameters from
    the module while it runs."""
    own = vars(module).get("forward")
    module.forward = function
    try:
        return module(*args)
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own


def full_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """A parameter's whole shape: DeepSpeed ZeRO-3 keeps it as ``ds_shape`` while the local tensor is a partition."""
    return tuple(getattr(tensor, "ds_shape", None) or tensor.shape)


def _wrapper_mixins() -> tuple[type, ...]:
    """The classes that FSDP2 (``fully_shard``) and ``replicate`` put first in a module's class when they wrap it."""
    mixins = []
    try:
        from torch.distributed.fsdp import FSDPModule

        mixins.append(FSDPModule)
    except ImportError:
        pass
    try:
        from torch.distributed._composable.replicate_with_fsdp import ReplicateModule

        mixins.append(ReplicateModule)
    except ImportError:
        pass
    return tuple(mixins)


def unwrapped_class(cls: type) -> type:
    """The module class under a ``FSDP<Class>`` wrapper class (itself when it is none)."""
    bases = cls.__bases__
    if len(bases) == 2 and bases[0] in _wrapper_mixins():
        return bases[1]
    return cls


def rewrapped_class(wrapper: type, inner: type) -> type:
    """``inner`` under the same wrapper as the class ``wrapper`` (``FSDPLigerX`` for ``FSDPNativeX``), made once per
    pair as the wrapper makes its own; ``inner`` itself when ``wrapper`` wraps nothing."""
    if unwrapped_class(wrapper) is wrapper:
        return inner
    mixin, prefix = wrapper.__bases__[0], wrapper.__name__[: -len(wrapper.__bases__[1].__name__)]
    made = _REWRAPPED.get((mixin, inner))
    if made is None:
        extra = {name: value for name, value in vars(wrapper).items() if name == "__deepcopy__"}
        made = _REWRAPPED[(mixin, inner)] = type(f"{prefix}{inner.__name__}", (mixin, inner), extra)
    return made


_REWRAPPED: dict[tuple[type, type], type] = {}
