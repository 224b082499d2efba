"""Compiled steps without a materialised causal mask: sdpa's ``is_causal`` where the mask can only be causal.

In eager code transformers hands sdpa no mask when a batch has no padding, no cache offset and no packed sequences,
and sdpa runs its causal kernels. Under torch.compile transformers before 5.24 never does; 5.24 and later read
``torch.compiler.is_exporting()``, which dynamo folds to ``True`` in some torch releases (2.11; 2.13 reads it
right). The compiled step then builds the [S, S] mask, and cuDNN attention applies it as a bias over every tile: at
4096 tokens its backward took 4.7x the causal one's time on an H100 (``benchmark/profile_step.py --compile``).

The causal-LM forwards of this package know from their own arguments when the mask can only be the causal one: no
attention mask, no position ids (so no packed sequences), no cache passed in, sdpa, every layer full attention.
Under torch.compile they then pass :data:`PLAIN_CAUSAL` with the model's keyword arguments. The MLA attention takes
it out of its kwargs and, if the mask reaching its sdpa call is the one the model built (no key selection folded
in), passes none, so sdpa applies ``is_causal``: the same scores. Other attention classes ignore the argument (every
attention function of transformers takes ``**kwargs``; the flag is only sent with sdpa).
"""

import torch

PLAIN_CAUSAL = "liger_dspine_plain_causal"
_CACHE_ARGUMENTS = ("past_key_values", "cache", "cache_position")


def plain_causal_kwargs(config, attention_mask, position_ids, kwargs: dict) -> dict:
    """``{PLAIN_CAUSAL: True}`` when compiling and the model's mask can only be the plain causal one, else ``{}``."""
    if not torch.compiler.is_compiling() or attention_mask is not None or position_ids is not None:
        return {}
    if any(kwargs.get(name) is not None for name in _CACHE_ARGUMENTS):
        return {}
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text_config, "_attn_implementation", None) != "sdpa":
        return {}
    if getattr(text_config, "sliding_window", None) or getattr(text_config, "attention_chunk_size", None):
        return {}
    if any(kind != "full_attention" for kind in getattr(text_config, "layer_types", None) or ()):
        return {}
    return {PLAIN_CAUSAL: True}


def take_plain_causal(kwargs: dict) -> bool:
    """Remove the flag from an attention module's kwargs; whether it was set."""
    return bool(kwargs.pop(PLAIN_CAUSAL, False))
