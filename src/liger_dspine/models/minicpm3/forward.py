"""MiniCPM3's causal-LM forwards with Liger losses: as ``modules/causal_lm_forward.py``'s, with the hidden states
divided by ``config.logits_scaling`` (``hidden_size / dim_model_base``) before ``lm_head``, as
``MiniCPM3ForCausalLM.forward`` does, in the fused loss too."""

from liger_dspine.modules.causal_lm_forward import _loss_forward


def scaled_head_input(model, hidden_states):
    """``hidden_states / config.logits_scaling``, the native expression (transformers < 5.24 has the same property)."""
    return hidden_states / model.config.logits_scaling


lce_forward = _loss_forward(
    "lce_forward",
    fused=True,
    vocab_chunked=False,
    doc="``MiniCPM3ForCausalLM.forward`` with liger-kernel's fused linear cross-entropy loss in training.",
    head_input=scaled_head_input,
)
lce_forward_vocab_chunked = _loss_forward(
    "lce_forward_vocab_chunked",
    fused=True,
    vocab_chunked=True,
    doc="MiniCPM3's ``lce_forward`` whose fused loss chunks over the vocabulary.",
    head_input=scaled_head_input,
)
ce_forward = _loss_forward(
    "ce_forward",
    fused=False,
    vocab_chunked=False,
    doc="``MiniCPM3ForCausalLM.forward`` with logits as usual and the loss from Liger's cross-entropy kernel.",
    head_input=scaled_head_input,
)

for _forward in (lce_forward, lce_forward_vocab_chunked, ce_forward):
    _forward.__module__ = __name__  # pickled by name: these, not the unscaled forwards of the shared module
