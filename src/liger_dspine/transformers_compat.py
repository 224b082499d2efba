"""Attributes that transformers renamed between the supported versions, read in one place.

Each entry lists a value's names, newest first, with the version that introduced the newest. A module or config
that has none of them is an error naming the class and the names looked for, never a silent default.
"""

import inspect

from torch import nn

try:  # transformers' output capture: the outputs a running forward records, keyed by name, in a context variable
    from transformers.utils.output_capturing import _active_collector
except ImportError:  # versions without output capture
    _active_collector = None


# transformers 5.25 renamed DeepseekV4UnweightedRMSNorm.eps to variance_epsilon, as the weighted norms call it.
NORM_EPSILON_NAMES = ("variance_epsilon", "eps")


def norm_epsilon(norm: nn.Module) -> float:
    """The epsilon of an RMSNorm module of any supported transformers version."""
    for name in NORM_EPSILON_NAMES:
        value = norm.__dict__.get(name)
        if value is not None:
            return float(value)
    names = " or ".join(NORM_EPSILON_NAMES)
    raise AttributeError(f"liger-dspine: {type(norm).__name__} has no epsilon attribute ({names})")


# The cache argument of DeepseekV4Attention.forward: "past_key_values" up to transformers 5.17, "cache" from 5.24,
# which also hands the forward's keyword arguments on to the cache layer's update.
CACHE_ARGUMENT_NAMES = ("cache", "past_key_values")


def cache_argument_name(forward) -> str:
    """The name under which ``forward`` (a native attention's forward) takes the key-value cache."""
    parameters = inspect.signature(forward).parameters
    for name in CACHE_ARGUMENT_NAMES:
        if name in parameters:
            return name
    names = " or ".join(CACHE_ARGUMENT_NAMES)
    raise TypeError(f"liger-dspine: {forward.__qualname__} takes no cache argument ({names})")


def attention_weights_recorded() -> bool:
    """Whether the running forward records attention weights (``output_attentions``): transformers' output capture
    collects them from the attention modules' outputs, under the key "attentions"."""
    if _active_collector is None:
        return False
    collected = _active_collector.get()
    return bool(collected) and "attentions" in collected
