"""``AutoLigerDSpineForCausalLM``: read the config, apply the matching patch at class level, then load."""

import inspect

from transformers import AutoConfig
from transformers import AutoModelForCausalLM

from liger_dspine.registry import MODEL_TYPE_TO_APPLY_LIGER_FN
from liger_dspine.registry import apply_liger_kernel


def _split_kwargs(model_type: str, kwargs: dict) -> tuple[dict, dict]:
    """(patch options, transformers kwargs): parameters of the patch function go to the patch."""
    apply_fn = MODEL_TYPE_TO_APPLY_LIGER_FN[model_type]
    params = set(inspect.signature(apply_fn).parameters) - {"model"}
    patch = {k: v for k, v in kwargs.items() if k in params}
    rest = {k: v for k, v in kwargs.items() if k not in params}
    return patch, rest


class AutoLigerDSpineForCausalLM:
    """Like ``AutoModelForCausalLM``, with this package's patch applied first (class level).

    An unsupported model type is a ValueError listing the supported ones.
    """

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        config = kwargs.get("config")
        if config is None:
            hub_kwargs = {k: kwargs[k] for k in ("revision", "trust_remote_code", "cache_dir", "token") if k in kwargs}
            config = AutoConfig.from_pretrained(pretrained_model_name_or_path, **hub_kwargs)
        patch, rest = _split_kwargs(_model_type(config), kwargs)
        apply_liger_kernel(_model_type(config), **patch)
        return AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, *model_args, **rest)

    @classmethod
    def from_config(cls, config, **kwargs):
        patch, rest = _split_kwargs(_model_type(config), kwargs)
        apply_liger_kernel(_model_type(config), **patch)
        return AutoModelForCausalLM.from_config(config, **rest)


def _model_type(config) -> str:
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        supported = ", ".join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))
        raise ValueError(f"liger-dspine has no patch for model type {model_type!r}; supported: {supported}")
    return model_type
