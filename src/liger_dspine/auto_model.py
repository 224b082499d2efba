"""``AutoLigerDSpineForCausalLM``: read the config, apply the matching patch at class level, then load."""

import inspect

from liger_dspine.registry import apply_fn_for
from liger_dspine.registry import apply_liger_kernel


def _apply_patch_for(config, kwargs: dict) -> dict:
    """Apply the patch of ``config.model_type`` with the kwargs that are its parameters; return the others
    (``dtype``, ``device_map``, ...) for transformers."""
    model_type = getattr(config, "model_type", None)
    params = set(inspect.signature(apply_fn_for(model_type)).parameters) - {"model"}
    apply_liger_kernel(model_type, **{k: v for k, v in kwargs.items() if k in params})
    return {k: v for k, v in kwargs.items() if k not in params}


class AutoLigerDSpineForCausalLM:
    """Like ``AutoModelForCausalLM``, with this package's patch applied first (class level).

    An unsupported model type is a ValueError listing the supported ones.
    """

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        from transformers import AutoConfig
        from transformers import AutoModelForCausalLM

        config = kwargs.get("config")
        if config is None:
            hub_kwargs = {k: kwargs[k] for k in ("revision", "trust_remote_code", "cache_dir", "token") if k in kwargs}
            config = AutoConfig.from_pretrained(pretrained_model_name_or_path, **hub_kwargs)
        rest = _apply_patch_for(config, kwargs)
        return AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, *model_args, **rest)

    @classmethod
    def from_config(cls, config, **kwargs):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(config, **_apply_patch_for(config, kwargs))
