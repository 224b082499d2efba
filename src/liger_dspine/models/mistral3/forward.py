"""Mistral-Small-4's (``Mistral3ForConditionalGeneration``) forwards with Liger losses, for text-only batches
(``modules/text_only_forward.py``): the output is transformers' ``Mistral3CausalLMOutputWithPast`` extended with
``token_accuracy``; a call with ``pixel_values`` or ``mm_encoder_outputs`` runs transformers' own forward."""

from dataclasses import dataclass

import torch
from transformers.models.mistral3.modeling_mistral3 import Mistral3CausalLMOutputWithPast

from liger_dspine.modules.text_only_forward import text_only_forwards

MODELING = "transformers.models.mistral3.modeling_mistral3"
MEDIA_INPUTS = ("pixel_values", "mm_encoder_outputs")


@dataclass
class LigerMistral3CausalLMOutputWithPast(Mistral3CausalLMOutputWithPast):
    token_accuracy: torch.Tensor | None = None


_FORWARDS = text_only_forwards(
    MODELING, "Mistral3ForConditionalGeneration", MEDIA_INPUTS, LigerMistral3CausalLMOutputWithPast, __name__
)
lce_forward = _FORWARDS["lce_forward"]
lce_forward_vocab_chunked = _FORWARDS["lce_forward_vocab_chunked"]
ce_forward = _FORWARDS["ce_forward"]
