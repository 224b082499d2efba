"""DSpine block drafter: configuration, native modeling, target capture, training objective and accumulation driver.

Names are imported on first use, so importing the patch (``apply``, ``spec``) does not import transformers'
modeling code (which imports Triton before a CPU interpreter could be switched on).
"""

import importlib

_EXPORTS = {
    "AdjacentInjection": "injection",
    "DSpineAccumulationWindow": "accumulation",
    "DSpineConfig": "configuration",
    "DSpineDraftConfig": "configuration",
    "DSpineDraftModel": "modeling",
    "DSpineObjective": "objective",
    "DSpineObjectiveOutput": "objective",
    "DSpineOutput": "modeling",
    "FrozenHeadTerms": "frozen_head_terms",
    "TargetCapture": "capture",
    "build_target_layer_ids": "configuration",
}

__all__ = sorted([*_EXPORTS, "register_auto_classes"])


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register_auto_classes() -> None:
    """Register ``model_type "dspine"`` with transformers' AutoConfig and AutoModel."""
    from transformers import AutoConfig
    from transformers import AutoModel

    from liger_dspine.models.dspine.configuration import DSpineDraftConfig
    from liger_dspine.models.dspine.modeling import DSpineDraftModel

    AutoConfig.register(DSpineDraftConfig.model_type, DSpineDraftConfig, exist_ok=True)
    AutoModel.register(DSpineDraftConfig, DSpineDraftModel, exist_ok=True)
