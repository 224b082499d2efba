"""Kimi K2.5 / K2.6's causal-LM forwards with Liger losses, for text-only batches (``modules/text_only_forward.py``):
the native loss is given ``text_config.vocab_size``, and the output is transformers' ``Kimi_K25CausalLMOutputWithPast``
(its image and video outputs, router logits and cache) extended with ``token_accuracy``. A call with
``pixel_values``, ``pixel_values_videos`` or ``mm_encoder_outputs`` runs transformers' own forward instead.
"""

from dataclasses import dataclass

import torch
from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25CausalLMOutputWithPast

from liger_dspine.modules.text_only_forward import text_only_forwards

MODELING = "transformers.models.kimi_k25.modeling_kimi_k25"
MEDIA_INPUTS = ("pixel_values", "pixel_values_videos", "mm_encoder_outputs")


@dataclass
class LigerKimiK25CausalLMOutputWithPast(Kimi_K25CausalLMOutputWithPast):
    token_accuracy: torch.Tensor | None = None


_FORWARDS = text_only_forwards(
    MODELING, "Kimi_K25ForConditionalGeneration", MEDIA_INPUTS, LigerKimiK25CausalLMOutputWithPast, __name__
)
lce_forward = _FORWARDS["lce_forward"]
lce_forward_vocab_chunked = _FORWARDS["lce_forward_vocab_chunked"]
ce_forward = _FORWARDS["ce_forward"]
