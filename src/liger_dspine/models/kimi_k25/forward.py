"""Kimi K2.5 / K2.6's causal-LM forwards with Liger losses, for text-only batches.

As ``modules/causal_lm_forward.py``'s, on ``Kimi_K25ForConditionalGeneration``: the native loss is given
``text_config.vocab_size``, and the output is transformers' ``Kimi_K25CausalLMOutputWithPast`` (its image and video
outputs, router logits and cache) extended with ``token_accuracy``.

A call with ``pixel_values``, ``pixel_values_videos`` or ``mm_encoder_outputs`` runs transformers' own forward instead
(logits, and transformers' loss with labels): the Liger loss path here covers the text-only case, the one this
package's parity tests check. ``skip_logits=True`` is then refused, since that forward always computes logits.
"""

from dataclasses import dataclass

import torch
from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25CausalLMOutputWithPast

from liger_dspine.modules.causal_lm_forward import _loss_forward
from liger_dspine.patching import original_method

MODELING = "transformers.models.kimi_k25.modeling_kimi_k25"
MEDIA_INPUTS = ("pixel_values", "pixel_values_videos", "mm_encoder_outputs")


@dataclass
class LigerKimiK25CausalLMOutputWithPast(Kimi_K25CausalLMOutputWithPast):
    token_accuracy: torch.Tensor | None = None


def text_vocab_size(model) -> int:
    return model.config.text_config.vocab_size


def _text_only(text_forward):
    """``text_forward`` for text-only batches; the native forward for batches with images or videos."""

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        skip_logits=None,
        **kwargs,
    ):
        if any(kwargs.get(name) is not None for name in MEDIA_INPUTS):
            if skip_logits:
                raise ValueError(
                    "liger-dspine: skip_logits=True needs a text-only batch: with pixel or video inputs Kimi K2.5 "
                    "runs transformers' forward, which computes logits"
                )
            native = original_method(MODELING, "Kimi_K25ForConditionalGeneration", "forward")
            return native(
                self,
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                inputs_embeds=inputs_embeds,
                labels=labels,
                use_cache=use_cache,
                logits_to_keep=logits_to_keep,
                **kwargs,
            )
        return text_forward(
            self, input_ids, attention_mask, position_ids, inputs_embeds, labels, use_cache, logits_to_keep,
            skip_logits, **kwargs,
        )  # fmt: skip

    forward.__name__ = forward.__qualname__ = text_forward.__name__
    forward.__doc__ = text_forward.__doc__
    forward.__module__ = __name__  # pickled by name: these, not the forwards of the shared module
    return forward


def _kimi_forward(name: str, fused: bool, vocab_chunked: bool, doc: str):
    text_forward = _loss_forward(
        name,
        fused=fused,
        vocab_chunked=vocab_chunked,
        doc=doc,
        output_class=LigerKimiK25CausalLMOutputWithPast,
        vocab_size=text_vocab_size,
    )
    return _text_only(text_forward)


lce_forward = _kimi_forward(
    "lce_forward",
    fused=True,
    vocab_chunked=False,
    doc="""``Kimi_K25ForConditionalGeneration.forward`` with liger-kernel's fused linear cross-entropy loss in
    training, for text-only batches (with images or videos: the native forward; see the module docstring).""",
)
lce_forward_vocab_chunked = _kimi_forward(
    "lce_forward_vocab_chunked",
    fused=True,
    vocab_chunked=True,
    doc="Kimi K2.5's ``lce_forward`` whose fused loss chunks over the vocabulary.",
)
ce_forward = _kimi_forward(
    "ce_forward",
    fused=False,
    vocab_chunked=False,
    doc="""``Kimi_K25ForConditionalGeneration.forward`` with logits as usual and the loss from Liger's cross-entropy
    kernel, for text-only batches (with images or videos: the native forward).""",
)
