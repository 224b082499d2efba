"""Causal-LM forwards whose loss comes from Liger kernels.

``lce_forward``: in training with labels (or ``shift_labels``) the loss comes from liger-kernel's fused linear
cross entropy, which projects the hidden states through ``lm_head`` chunk by chunk and never holds the
[tokens, vocab] logits; ``logits`` is then None. ``skip_logits`` overrides that choice. Otherwise (eval, no
labels) logits are computed as transformers computes them.
``ce_forward``: logits as usual, loss from Liger's cross-entropy kernel (the ``cross_entropy=True`` option).

Both return the native output class extended with ``token_accuracy``; ``return_dict=False`` gives its tuple.
"""

from dataclasses import dataclass
from dataclasses import fields

import torch
from transformers.modeling_outputs import MoeCausalLMOutputWithPast

from liger_dspine._interpreter import check_kernel_device

try:  # newer transformers also take 2D positions [B, P] and boolean masks [B, S] (logits [N, V])
    from transformers.modeling_utils import slice_logits_to_keep as _slice_logits_to_keep
except ImportError:
    _slice_logits_to_keep = None

IGNORE_INDEX = -100


@dataclass
class LigerCausalLMOutputWithPast(MoeCausalLMOutputWithPast):
    token_accuracy: torch.Tensor | None = None


def lce_forward(
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
    return _causal_lm_forward(
        self,
        input_ids,
        attention_mask,
        position_ids,
        inputs_embeds,
        labels,
        use_cache,
        logits_to_keep,
        skip_logits,
        fused=True,
        **kwargs,
    )


def ce_forward(
    self,
    input_ids=None,
    attention_mask=None,
    position_ids=None,
    inputs_embeds=None,
    labels=None,
    use_cache=None,
    logits_to_keep=0,
    **kwargs,
):
    return _causal_lm_forward(
        self,
        input_ids,
        attention_mask,
        position_ids,
        inputs_embeds,
        labels,
        use_cache,
        logits_to_keep,
        skip_logits=False,
        fused=False,
        **kwargs,
    )


def _causal_lm_forward(
    self,
    input_ids,
    attention_mask,
    position_ids,
    inputs_embeds,
    labels,
    use_cache,
    logits_to_keep,
    skip_logits,
    fused,
    **kwargs,
):
    return_dict = kwargs.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    shift_labels = kwargs.pop("shift_labels", None)
    has_labels = labels is not None or shift_labels is not None
    if skip_logits and not has_labels:
        raise ValueError("skip_logits=True needs labels or shift_labels: without them there is no loss to compute")

    outputs = self.model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        inputs_embeds=inputs_embeds,
        use_cache=use_cache,
        **kwargs,
    )
    hidden_states = _keep_positions(outputs.last_hidden_state, logits_to_keep)

    if skip_logits is None:
        skip_logits = fused and self.training and has_labels

    loss = logits = token_accuracy = None
    num_items_in_batch = kwargs.get("num_items_in_batch")
    if has_labels:
        targets = _shifted_targets(labels, shift_labels, hidden_states)
    if skip_logits:
        loss, token_accuracy = _fused_linear_ce(hidden_states, self.lm_head.weight, targets, num_items_in_batch)
    else:
        logits = self.lm_head(hidden_states)
        if has_labels:
            if fused:
                loss = self.loss_function(
                    logits=logits,
                    labels=labels,
                    shift_labels=None if shift_labels is None else shift_labels.contiguous(),  # the loss views it
                    vocab_size=self.config.vocab_size,
                    **kwargs,
                )
            else:
                loss = _liger_ce(logits, targets, num_items_in_batch)

    output = LigerCausalLMOutputWithPast(loss=loss, logits=logits, token_accuracy=token_accuracy)
    for f in fields(output):
        if f.name not in ("loss", "logits", "token_accuracy") and f.name in outputs:
            setattr(output, f.name, outputs[f.name])
    return output if return_dict else output.to_tuple()


def _keep_positions(hidden_states: torch.Tensor, logits_to_keep) -> torch.Tensor:
    """The positions of ``hidden_states`` [B, S, H] that get logits, as the native forward selects them."""
    if _slice_logits_to_keep is not None:
        return _slice_logits_to_keep(hidden_states, logits_to_keep)
    if isinstance(logits_to_keep, int):
        return hidden_states[:, -logits_to_keep:, :] if logits_to_keep else hidden_states
    return hidden_states[:, logits_to_keep, :]


def _shifted_targets(labels, shift_labels, hidden_states) -> torch.Tensor:
    """Next-token targets aligned with ``hidden_states`` [B, S, H], flattened to [B*S]."""
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    if shift_labels.shape != hidden_states.shape[:-1]:
        raise ValueError(
            f"labels of shape {tuple(shift_labels.shape)} do not match the hidden states "
            f"{tuple(hidden_states.shape[:-1])} they are the targets of (check logits_to_keep and shift_labels)"
        )
    return shift_labels.reshape(-1).to(hidden_states.device)


def _fused_linear_ce(hidden_states, weight, targets, num_items_in_batch):
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    check_kernel_device(hidden_states, "fused linear cross entropy")
    reduction = "sum" if num_items_in_batch is not None else "mean"
    result = liger_fused_linear_cross_entropy(
        hidden_states.reshape(-1, hidden_states.shape[-1]),
        weight,
        targets,
        ignore_index=IGNORE_INDEX,
        reduction=reduction,
        return_token_accuracy=True,
    )
    loss, token_accuracy = result.loss, result.token_accuracy
    if num_items_in_batch is not None:
        loss = loss / num_items_in_batch
    return loss, token_accuracy


def _liger_ce(logits, targets, num_items_in_batch):
    from liger_kernel.transformers.functional import liger_cross_entropy

    check_kernel_device(logits, "Liger cross entropy")
    reduction = "sum" if num_items_in_batch is not None else "mean"
    # The kernel writes the gradient into its input: give it an fp32 copy, never the logits returned to the caller.
    logits_fp32 = logits.reshape(-1, logits.shape[-1]).to(torch.float32, copy=True)
    loss = liger_cross_entropy(logits_fp32, targets, ignore_index=IGNORE_INDEX, reduction=reduction)
    if num_items_in_batch is not None:
        loss = loss / num_items_in_batch
    return loss
