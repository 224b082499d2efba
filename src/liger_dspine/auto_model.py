"""``AutoLigerDSpineForCausalLM``: read the config, apply the matching patch at class level, then load."""

import importlib
import inspect

from liger_dspine.registry import apply_fn_for
from liger_dspine.registry import apply_liger_kernel
from liger_dspine.registry import model_type_for_config


def _apply_patch_for(config, kwargs: dict) -> dict:
    """Apply the patch of the config's model type (``model_type_for_config``) with the kwargs that are its
    parameters; return the others (``dtype``, ``device_map``, ...) for transformers."""
    model_type = model_type_for_config(config)
    params = set(inspect.signature(apply_fn_for(model_type)).parameters) - {"model"}
    apply_liger_kernel(model_type, **{k: v for k, v in kwargs.items() if k in params})
    return {k: v for k, v in kwargs.items() if k not in params}


def causal_lm_class(config):
    """``AutoModelForCausalLM``, or the model's own causal LM where transformers' auto mapping has none for this
    config: its ``*ForCausalLM`` class (``mistral4``, whose checkpoints load as a multimodal model, has a text-only
    one), else its ``*ForConditionalGeneration`` class (``kimi_k25``: the multimodal model is the causal LM)."""
    from transformers import AutoModelForCausalLM

    if type(config) in AutoModelForCausalLM._model_mapping:
        return AutoModelForCausalLM
    model_type = config.model_type
    try:
        modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    except ModuleNotFoundError:
        return AutoModelForCausalLM  # its error names the model type
    classes = [value for value in vars(modeling).values() if isinstance(value, type)]
    for suffix in ("ForCausalLM", "ForConditionalGeneration"):
        for value in classes:
            if value.__name__.endswith(suffix) and getattr(value, "config_class", None) is type(config):
                return value
    return AutoModelForCausalLM


def causal_lm_from_config(config, **kwargs):
    """The causal LM of ``config`` (:func:`causal_lm_class`), built from it."""
    model_class = causal_lm_class(config)
    if model_class.__name__ == "AutoModelForCausalLM":
        return model_class.from_config(config, **kwargs)
    return model_class._from_config(config, **kwargs)


class AutoLigerDSpineForCausalLM:
    """Like ``AutoModelForCausalLM``, with this package's patch applied first (class level); a model type that the
    auto mapping lacks but whose modeling module has a causal LM (``mistral4``, ``kimi_k25``) is built through that
    class.

    A DSpine drafter (SpecForge's layout or the older ``model_type "dspine"``, recognised by its architecture and
    ``dspine_config`` before its model type) loads as ``DSpineDraftModel``. An unsupported model type is a
    ValueError listing the supported ones.
    """

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        from transformers import AutoConfig
        from transformers import AutoModelForCausalLM
        from transformers import PretrainedConfig

        from liger_dspine.models.dspine.configuration import DSpineDraftConfig
        from liger_dspine.models.dspine.configuration import is_dspine_config_dict

        config = kwargs.get("config")
        if config is None:
            hub_kwargs = {k: kwargs[k] for k in ("revision", "trust_remote_code", "cache_dir", "token") if k in kwargs}
            config_dict, _ = PretrainedConfig.get_config_dict(pretrained_model_name_or_path, **hub_kwargs)
            if is_dspine_config_dict(config_dict):  # either layout; SpecForge's says model_type "qwen3"
                config = DSpineDraftConfig.from_dict(config_dict)
            else:
                config = AutoConfig.from_pretrained(pretrained_model_name_or_path, **hub_kwargs)
        rest = _apply_patch_for(config, kwargs)
        if model_type_for_config(config) == "dspine":
            from liger_dspine.models.dspine.modeling import DSpineDraftModel

            config = config if isinstance(config, DSpineDraftConfig) else DSpineDraftConfig.from_dict(config.to_dict())
            return DSpineDraftModel.from_pretrained(
                pretrained_model_name_or_path, *model_args, **{**rest, "config": config}
            )
        model_class = causal_lm_class(config)
        if model_class is AutoModelForCausalLM:
            return AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, *model_args, **rest)
        return model_class.from_pretrained(pretrained_model_name_or_path, *model_args, config=config, **rest)

    @classmethod
    def from_config(cls, config, **kwargs):
        rest = _apply_patch_for(config, kwargs)
        if model_type_for_config(config) == "dspine":
            from liger_dspine.models.dspine.modeling import DSpineDraftModel

            return DSpineDraftModel(config, **rest)
        return causal_lm_from_config(config, **rest)
