"""DSpine block drafter: configuration, native modeling, training objective and accumulation driver."""

from liger_dspine.models.dspine.accumulation import DSpineAccumulationWindow
from liger_dspine.models.dspine.configuration import DSpineConfig
from liger_dspine.models.dspine.configuration import DSpineDraftConfig
from liger_dspine.models.dspine.configuration import build_target_layer_ids
from liger_dspine.models.dspine.frozen_head_terms import FrozenHeadTerms
from liger_dspine.models.dspine.injection import AdjacentInjection
from liger_dspine.models.dspine.modeling import DSpineDraftModel
from liger_dspine.models.dspine.modeling import DSpineOutput
from liger_dspine.models.dspine.objective import DSpineObjective
from liger_dspine.models.dspine.objective import DSpineObjectiveOutput

__all__ = [
    "AdjacentInjection",
    "DSpineAccumulationWindow",
    "DSpineConfig",
    "DSpineDraftConfig",
    "DSpineDraftModel",
    "DSpineObjective",
    "DSpineObjectiveOutput",
    "DSpineOutput",
    "FrozenHeadTerms",
    "build_target_layer_ids",
    "register_auto_classes",
]


def register_auto_classes() -> None:
    """Register ``model_type "dspine"`` with transformers' AutoConfig and AutoModel."""
    from transformers import AutoConfig
    from transformers import AutoModel

    AutoConfig.register(DSpineDraftConfig.model_type, DSpineDraftConfig, exist_ok=True)
    AutoModel.register(DSpineDraftConfig, DSpineDraftModel, exist_ok=True)
