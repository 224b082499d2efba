"""Loss forwards for a multimodal ``*ForConditionalGeneration`` whose text model this package patches (Kimi K2.5,
Mistral-Small-4): ``modules/causal_lm_forward.py``'s forwards for text-only batches, with the native loss given
``text_config.vocab_size`` and the model's own output class extended with ``token_accuracy``.

A call with image or video inputs runs transformers' own forward instead (logits, and transformers' loss with
labels): the Liger loss path covers the text-only case. ``skip_logits=True`` is then refused, since that forward
always computes logits.
"""

from liger_dspine.modules.causal_lm_forward import _loss_forward
from liger_dspine.patching import original_method


def text_vocab_size(model) -> int:
    return model.config.text_config.vocab_size


def text_only_forwards(modeling: str, owner: str, media_inputs: tuple[str, ...], output_class, module: str) -> dict:
    """``{"lce_forward": ..., "lce_forward_vocab_chunked": ..., "ce_forward": ...}`` for ``modeling.owner``.

    ``media_inputs``: the keyword arguments that carry images or videos; ``output_class``: the model's output class
    with a last field ``token_accuracy``; ``module``: the module that binds the forwards to its names (they are
    pickled by name)."""
    forwards = {}
    for name, fused, vocab_chunked in (
        ("lce_forward", True, False),
        ("lce_forward_vocab_chunked", True, True),
        ("ce_forward", False, False),
    ):
        text_forward = _loss_forward(
            name,
            fused=fused,
            vocab_chunked=vocab_chunked,
            doc=f"``{owner}.forward`` with {'the fused' if fused else 'Liger cross-entropy'} loss for text-only "
            "batches; with image or video inputs, transformers' forward (``modules/text_only_forward.py``).",
            output_class=output_class,
            vocab_size=text_vocab_size,
        )
        forwards[name] = _text_only(text_forward, modeling, owner, media_inputs, module)
    return forwards


def _text_only(text_forward, modeling: str, owner: str, media_inputs: tuple[str, ...], module: str):
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
        if any(kwargs.get(name) is not None for name in media_inputs):
            if skip_logits:
                raise ValueError(
                    f"liger-dspine: skip_logits=True needs a text-only batch: with image or video inputs {owner} "
                    "runs transformers' forward, which computes logits"
                )
            native = original_method(modeling, owner, "forward")
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
    forward.__module__ = module  # pickled by name: the model's forwards, not the shared module's
    return forward
