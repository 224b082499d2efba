"""What the fused linear cross entropy needs of ``lm_head``: it reads ``lm_head.weight`` and never calls the module,
so the head must compute ``hidden @ weight.T`` and nothing else, with a weight that is whole inside the forward."""

import torch
from torch import nn


def unfused_head_reason(head: nn.Module) -> str | None:
    """Why calling ``head`` would compute something other than ``hidden @ head.weight.T``, or None.

    A LoRA adapter (PEFT wraps the head), a quantized or otherwise custom head, or forward hooks on it: the fused loss
    would silently leave them out, so the loss is computed from the head's own output instead."""
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward:
        return f"lm_head is a {type(head).__module__}.{type(head).__qualname__}, not a plain torch.nn.Linear"
    if getattr(head, "bias", None) is not None:
        return "lm_head has a bias"
    if head._forward_hooks or head._forward_pre_hooks:
        return "lm_head has forward hooks"
    if "forward" in vars(head) and not hasattr(head, "_hf_hook"):  # accelerate's hook only moves the inputs
        return "lm_head's forward is replaced on the module"
    return None


def check_head_is_gathered(weight: torch.Tensor) -> None:
    """The fused loss reads ``lm_head.weight`` without calling ``lm_head``: a sharded weight must be whole by now."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed support
        return
    if isinstance(weight, DTensor):
        raise ValueError(
            "liger-dspine: lm_head.weight is a sharded DTensor inside the forward: the fused linear cross entropy "
            "reads the weight without calling lm_head, so a separately sharded lm_head (FSDP2 "
            "fully_shard(model.lm_head), or tensor parallel) is never gathered for it. Shard lm_head together with its "
            "parent (fully_shard(model) without its own fully_shard), or pass skip_logits=False to compute the loss "
            "from logits"
        )
