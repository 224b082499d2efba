"""``liger-dspine inspect``: build the model of a model type, a config.json or a checkpoint folder on the meta device,
patch it, and print what the patch replaced.

Every input it cannot use is a ``ValueError`` of one line starting with ``liger-dspine:``: a path that does not
exist, a folder without a config.json, a config.json that is not a JSON object or names no model type, a model type
no patch serves (the closest supported names for one transformers does not know either). A DSpine drafter's
config.json (either layout) is inspected as ``dspine``; the bare model type ``dspine`` builds a drafter of Qwen3's
default sizes.
"""

import difflib
import os
from pathlib import Path

# by model type: what the default config needs to be the model the patch covers (mistral3: Mistral-Small-4)
_PATCHED_DEFAULTS = {"mistral3": {"text_config": {"model_type": "mistral4"}}}

# the drafter `inspect dspine` builds (a DSpine drafter has no default config): Qwen3's default sizes otherwise
DEFAULT_DRAFTER = {"num_hidden_layers": 5, "block_size": 16, "num_target_layers": 36}

USAGE = "inspect takes a model type such as deepseek_v3, a config.json or a checkpoint folder"


def inspect_report(arg: str) -> list[str]:
    """The lines ``liger-dspine inspect ARG`` prints: notes on the config taken, then the patch report."""
    import torch

    from liger_dspine import apply_liger_kernel_to_instance

    config, notes = resolve_config(arg)
    with torch.device("meta"):
        model = _build(config)
    lines = notes + [str(apply_liger_kernel_to_instance(model))]
    if _is_drafter(config):
        lines += _objective_swaps()
    return lines


def resolve_config(arg: str):
    """``(config, notes)`` for a folder, a JSON file or a model type; ValueError (one line) for what is none."""
    path = Path(arg)
    if path.is_dir():
        if not (path / "config.json").is_file():
            what = "is an empty folder" if not any(path.iterdir()) else "has no config.json"
            raise ValueError(f"liger-dspine: {path} {what}; {USAGE}")
        return _config_of_file(path / "config.json"), []
    if path.is_file():
        return _config_of_file(path), []
    if os.sep in arg or "/" in arg or arg.endswith(".json"):
        raise ValueError(f"liger-dspine: {arg} does not exist; {USAGE}")
    return _config_of_model_type(arg)


def _config_of_file(path: Path):
    from liger_dspine.models.dspine.checkpoint import read_json_object
    from liger_dspine.models.dspine.configuration import DSpineDraftConfig
    from liger_dspine.models.dspine.configuration import is_dspine_config_dict

    config_dict = read_json_object(path)
    if is_dspine_config_dict(config_dict):
        try:
            return DSpineDraftConfig.from_dict(config_dict)
        except (ValueError, TypeError) as error:
            raise ValueError(f"liger-dspine: {path} is not a valid DSpine drafter config: {error}") from None
    model_type = config_dict.get("model_type")
    if not isinstance(model_type, str):
        raise ValueError(f"liger-dspine: {path} names no model_type (got {model_type!r}); {USAGE}")
    _check_model_type(model_type, f"{path} has model_type {model_type!r}, which transformers does not know")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type].from_dict(config_dict)


def _config_of_model_type(model_type: str):
    if model_type == "dspine":
        from liger_dspine.models.dspine.configuration import DSpineDraftConfig

        taken = ", ".join(f"{name}={value}" for name, value in DEFAULT_DRAFTER.items())
        note = f"(a DSpine drafter has no default config; taken to build one: Qwen3's default sizes, {taken})"
        return DSpineDraftConfig(**DEFAULT_DRAFTER), [note]
    _check_model_type(model_type, f"unknown model type {model_type!r} (and no file or folder of that name)")
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **_PATCHED_DEFAULTS.get(model_type, {}))
    filled = _fill_unset_expert_counts(config.get_text_config(decoder=True))
    notes = []
    if filled:
        taken = ", ".join(f"{name}={value}" for name, value in filled.items())
        notes.append(f"(the default {type(config).__name__} leaves expert counts unset; taken to build it: {taken})")
    return config, notes


def _check_model_type(model_type: str, unknown: str) -> None:
    """Refuse a model type no patch serves: the registry's message for one transformers knows, the closest supported
    names for one it does not; and a supported one the installed transformers lacks."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from liger_dspine.registry import MODEL_TYPE_TO_APPLY_LIGER_FN
    from liger_dspine.registry import apply_fn_for

    known = model_type in CONFIG_MAPPING
    if model_type in MODEL_TYPE_TO_APPLY_LIGER_FN:
        if not known:
            raise ValueError(
                f"liger-dspine: model type {model_type!r} has a patch, but transformers {transformers.__version__} "
                "does not know it: install a transformers version that has it"
            )
        return
    if known:
        apply_fn_for(model_type)  # raises, naming it unsupported and listing the supported types
    supported = sorted(MODEL_TYPE_TO_APPLY_LIGER_FN)
    closest = difflib.get_close_matches(model_type, supported, n=3, cutoff=0.6)
    hint = f"closest supported: {', '.join(closest)}" if closest else f"supported: {', '.join(supported)}"
    raise ValueError(f"liger-dspine: {unknown}; {hint}")


def _is_drafter(config) -> bool:
    from liger_dspine.models.dspine.configuration import DSpineDraftConfig

    return isinstance(config, DSpineDraftConfig)


def _build(config):
    if _is_drafter(config):
        from liger_dspine.models.dspine.modeling import DSpineDraftModel

        return DSpineDraftModel(config)
    from liger_dspine.auto_model import causal_lm_from_config

    return causal_lm_from_config(config)


def _objective_swaps() -> list[str]:
    """The dspine swaps of an objective over the drafter (an objective needs a target, so it is not built here)."""
    from liger_dspine.models.dspine.spec import DSPINE_SPEC
    from liger_dspine.patching import MethodSwap

    method_swaps = [swap for swap in DSPINE_SPEC.swaps if isinstance(swap, MethodSwap)]
    return [
        f"  and on a DSpineObjective over the drafter: {swap.owner}.{swap.method} -> "
        + swap.replacement.replace(":", ".")
        for swap in method_swaps
    ]


def _fill_unset_expert_counts(config) -> dict[str, int]:
    """Expert counts some configs leave None by default (Dots1Config), set to the smallest a grouped router takes
    (two experts per group); the modules they size are built all the same."""
    smallest = {
        "n_routed_experts": 2 * (getattr(config, "n_group", None) or 1),
        "num_experts_per_tok": 1,
        "n_shared_experts": 1,
    }
    filled = {name: n for name, n in smallest.items() if hasattr(config, name) and getattr(config, name) is None}
    for name, value in filled.items():
        setattr(config, name, value)
    return filled
