"""What the fused linear cross entropy needs of ``lm_head``: it reads ``lm_head.weight`` and never calls the module,
so the head must compute ``hidden @ weight.T`` and nothing else, with a weight that is whole inside the forward."""

from torch import nn

from liger_dspine.modules.parallel_state import parameter_hooks_only
from liger_dspine.modules.parallel_state import tensor_parallel_head


def unfused_head_reason(head: nn.Module) -> str | None:
    """Why calling ``head`` would compute something other than ``hidden @ head.weight.T``, or None.

    A LoRA adapter (PEFT wraps the head), a quantized or otherwise custom head, or forward hooks on it: the fused loss
    would silently leave them out, so the loss is computed from the head's own output instead."""
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward:
        return f"lm_head is a {type(head).__module__}.{type(head).__qualname__}, not a plain torch.nn.Linear"
    if getattr(head, "bias", None) is not None:
        return "lm_head has a bias"
    if (head._forward_hooks or head._forward_pre_hooks) and not parameter_hooks_only(head):
        return "lm_head has forward hooks"
    if "forward" in vars(head) and not hasattr(head, "_hf_hook") and not tensor_parallel_head(head):
        # accelerate's hook only moves the inputs; tensor parallelism's forward (transformers marks the modules its
        # plans install forwards on) only moves its input and output
        return "lm_head's forward is replaced on the module"
    return None
