"""What the mistral3 patch replaces: Mistral-Small-4 checkpoints load as ``Mistral3ForConditionalGeneration`` (a
Pixtral vision tower, a projector and a ``mistral4`` text model). The text model takes the mistral4 patch's swaps
(``models/mistral4/spec.py``), the projector's ``Mistral3RMSNorm`` the RMSNorm swap, and the loss options replace
``Mistral3ForConditionalGeneration.forward`` (text-only batches, ``text_config``'s vocabulary). The vision tower
stays native.

At class level the text swaps rebind Mistral4's classes, which ``Mistral4ForCausalLM`` models share, as a class-level
mistral4 patch does; the engine keeps a swap both patches applied until both are reverted.
"""

from dataclasses import replace

from liger_dspine.models.mistral4.spec import MISTRAL4_SPEC
from liger_dspine.models.mistral4.spec import MODELING as MISTRAL4_MODELING
from liger_dspine.patching import ClassSwap
from liger_dspine.patching import MethodSwap
from liger_dspine.patching import PatchSpec

MODELING = "transformers.models.mistral3.modeling_mistral3"
FORWARDS = "liger_dspine.models.mistral3.forward"
OWNER = "Mistral3ForConditionalGeneration"


def _text_swaps():
    for swap in MISTRAL4_SPEC.swaps:
        if isinstance(swap, MethodSwap) and swap.owner == "Mistral4ForCausalLM":
            name = swap.replacement.rpartition(":")[2]
            yield MethodSwap(swap.option, OWNER, "forward", f"{FORWARDS}:{name}", module=MODELING)
        else:
            yield replace(swap, module=swap.module or MISTRAL4_MODELING)


MISTRAL3_SPEC = PatchSpec(
    model_type="mistral3",
    module=MISTRAL4_MODELING,
    base_classes=(f"{MODELING}:Mistral3PreTrainedModel",),
    swaps=(
        ClassSwap("rms_norm", ("Mistral3RMSNorm",), "liger_dspine.modules.rms_norm:LigerRMSNorm", module=MODELING),
        *_text_swaps(),
    ),
    checks=MISTRAL4_SPEC.checks,
)
