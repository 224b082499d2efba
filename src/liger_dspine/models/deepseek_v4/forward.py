"""DeepSeek-V4's causal-LM forwards with Liger losses: ``modules/causal_lm_forward.py``'s, plus the load-balancing
auxiliary loss as ``DeepseekV4ForCausalLM.forward`` adds it. With ``output_router_logits`` (the argument, else the
config's) the decoder records the learned routers' logits, ``aux_loss`` is transformers' own
``load_balancing_loss_func`` of them (this transformers' modeling module's function), and with labels the loss is the
token loss plus ``router_aux_loss_coef * aux_loss``."""

import importlib

from liger_dspine.modules import causal_lm_forward as shared

MODELING = "transformers.models.deepseek_v4.modeling_deepseek_v4"


def _with_aux_loss(base, name: str, doc: str):
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
        output_router_logits=None,
        **kwargs,
    ):
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        return_dict = kwargs.pop("return_dict", None)
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        output = base(
            self,
            input_ids,
            attention_mask,
            position_ids,
            inputs_embeds,
            labels,
            use_cache,
            logits_to_keep,
            skip_logits,
            output_router_logits=output_router_logits,
            return_dict=True,
            **kwargs,
        )
        if output_router_logits:
            load_balancing_loss = importlib.import_module(MODELING).load_balancing_loss_func
            output.aux_loss = load_balancing_loss(
                output.router_logits, self.num_experts, self.num_experts_per_tok, attention_mask
            )
            if output.loss is not None:
                output.loss = output.loss + self.router_aux_loss_coef * output.aux_loss.to(output.loss.device)
        return output if return_dict else shared._to_tuple(output)

    forward.__name__ = forward.__qualname__ = name
    forward.__doc__ = doc
    return forward


lce_forward = _with_aux_loss(
    shared.lce_forward,
    "lce_forward",
    "``DeepseekV4ForCausalLM.forward`` with liger-kernel's fused linear cross-entropy loss in training.",
)
lce_forward_vocab_chunked = _with_aux_loss(
    shared.lce_forward_vocab_chunked,
    "lce_forward_vocab_chunked",
    "DeepSeek-V4's ``lce_forward`` whose fused loss chunks over the vocabulary.",
)
ce_forward = _with_aux_loss(
    shared.ce_forward,
    "ce_forward",
    "``DeepseekV4ForCausalLM.forward`` with logits as usual and the loss from Liger's cross-entropy kernel.",
)

for _forward in (lce_forward, lce_forward_vocab_chunked, ce_forward):
    _forward.__module__ = __name__  # pickled by name
