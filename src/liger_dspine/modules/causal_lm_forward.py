"""Causal-LM forwards whose loss comes from Liger kernels.

``lce_forward``: in training with labels (or ``shift_labels``) the loss comes from liger-kernel's fused linear
cross entropy (its forward kernels, with a backward that scales the kept gradients on the device: no host
synchronisation), which projects the hidden states through ``lm_head`` chunk by chunk and never holds the
[tokens, vocab] logits; ``logits`` is then None. ``skip_logits`` overrides that choice. Otherwise (eval, no
labels) logits are computed as transformers computes them.
``ce_forward``: logits as usual, loss from Liger's cross-entropy kernel (the ``cross_entropy=True`` option).

Both return the native output class extended with ``token_accuracy``. ``return_dict=False`` gives the tuple
liger-kernel's ``lce_forward`` gives: transformers' fields that are not None in their order, except that the logits
slot stays at its index (None when the fused loss skipped them; ``loss, logits = out[:2]`` works), then
``token_accuracy`` when the fused path computed it.

The labels are checked before any kernel reads them (``label_checks.py``). ``ignore_index`` (default -100) is taken
as transformers' loss takes it.

Loss: the sum of the token losses divided by ``num_items_in_batch`` when given, else by the number of targets
that are not ignored; a divisor of 0 counts as 1. Deliberate difference from transformers: when every target is
ignored (a micro-batch of padding, or prompt-only samples) the loss is 0 and every gradient is 0, in all paths,
where the native forward returns NaN (and, with ``num_items_in_batch=0``, liger-kernel's fused loss gives NaN
gradients). ``token_accuracy`` is then NaN: there is no token to score.

The fused loss reads ``lm_head.weight`` directly (``head_checks.py``). A head that computes something else (a LoRA
adapter on it, a bias, forward hooks, a custom class) gets the loss from its own logits, with a warning; with
``skip_logits=True`` it is a ``ValueError``. Under FSDP2, a ``lm_head`` sharded with its parent is gathered by the
root's pre-forward; one sharded on its own takes the logits path, with a warning (``parallel_state.py``). Under tensor
parallelism, the vocabulary-sharded head takes the vocabulary-parallel fused loss: no rank forms the whole logits.

liger-kernel's loss keywords that this forward does not compute (``label_smoothing``, ``lse_square_scale``,
``softcap``, ``ce_weight``, ``use_token_scaling``, ``return_predicted_tokens``) are a ``ValueError`` unless at their
defaults, instead of being passed on to the decoder, which ignores them.
"""

import warnings
from dataclasses import dataclass
from dataclasses import fields

import torch
from transformers.modeling_outputs import MoeCausalLMOutputWithPast

from liger_dspine._interpreter import check_kernel_device
from liger_dspine.modules.backward_guard import SecondPassGuard
from liger_dspine.modules.backward_guard import refuse_later_passes
from liger_dspine.modules.causal_mask import plain_causal_kwargs
from liger_dspine.modules.compiled_embedding import compiled_input_embeddings
from liger_dspine.modules.head_checks import unfused_head_reason
from liger_dspine.modules.label_checks import IGNORE_INDEX
from liger_dspine.modules.label_checks import checked_labels
from liger_dspine.modules.parallel_state import call_through_hooks
from liger_dspine.modules.parallel_state import gathered_by_hooks
from liger_dspine.modules.parallel_state import sharded_head_reason
from liger_dspine.modules.parallel_state import vocab_shard

try:  # newer transformers also take 2D positions [B, P] and boolean masks [B, S] (logits [N, V])
    from transformers.modeling_utils import slice_logits_to_keep as _slice_logits_to_keep
except ImportError:
    _slice_logits_to_keep = None

# liger-kernel's loss keywords, with the values at which they change nothing
_LIGER_LOSS_DEFAULTS = {
    "label_smoothing": 0.0,
    "lse_square_scale": 0.0,
    "softcap": None,
    "ce_weight": None,
    "use_token_scaling": False,
    "return_predicted_tokens": False,
}


@dataclass
class LigerCausalLMOutputWithPast(MoeCausalLMOutputWithPast):
    token_accuracy: torch.Tensor | None = None


def _loss_forward(
    name: str,
    fused: bool,
    vocab_chunked: bool,
    doc: str,
    head_input=None,
    output_class=LigerCausalLMOutputWithPast,
    vocab_size=None,
):
    """A ``ForCausalLM.forward`` replacement whose loss path is fixed by ``fused`` / ``vocab_chunked``.

    ``head_input(model, last_hidden_state)``: what the model feeds its ``lm_head`` (MiniCPM3 scales it down), before
    the positions are selected, as the native forward does; None: the last hidden state itself.
    ``output_class``: the native output class extended with ``token_accuracy`` (the last field).
    ``vocab_size(model)``: the vocabulary the native loss is given; None: ``config.vocab_size``.
    """

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
        if not fused and skip_logits:
            raise ValueError(
                "liger-dspine: skip_logits=True needs the fused loss; this forward computes the loss from logits"
            )
        return _causal_lm_forward(
            self,
            input_ids,
            attention_mask,
            position_ids,
            inputs_embeds,
            labels,
            use_cache,
            logits_to_keep,
            skip_logits if fused else False,
            fused=fused,
            vocab_chunked=vocab_chunked,
            head_input=head_input,
            output_class=output_class,
            vocab_size=vocab_size,
            **kwargs,
        )

    forward.__name__ = forward.__qualname__ = name
    forward.__doc__ = doc
    return forward


lce_forward = _loss_forward(
    "lce_forward",
    fused=True,
    vocab_chunked=False,
    doc="""``DeepseekV3ForCausalLM.forward`` with liger-kernel's fused linear cross-entropy loss in training (see the
    module docstring: label checks, and a loss of 0 instead of NaN when every label is ignored).""",
)
lce_forward_vocab_chunked = _loss_forward(
    "lce_forward_vocab_chunked",
    fused=True,
    vocab_chunked=True,
    doc="""``lce_forward`` whose fused loss chunks over the vocabulary (``ops/linear_cross_entropy.py``): no lm_head
    gradient buffer is held from forward to backward, and each gradient element is rounded once.""",
)
ce_forward = _loss_forward(
    "ce_forward",
    fused=False,
    vocab_chunked=False,
    doc="""``DeepseekV3ForCausalLM.forward`` with logits as usual and the loss from Liger's cross-entropy kernel.""",
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
    vocab_chunked=False,
    head_input=None,
    output_class=LigerCausalLMOutputWithPast,
    vocab_size=None,
    **kwargs,
):
    return_dict = kwargs.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    shift_labels = kwargs.pop("shift_labels", None)
    accum_dtype = _checked_accum_dtype(kwargs.pop("accum_dtype", None))
    ignore_index = _checked_ignore_index(kwargs.pop("ignore_index", IGNORE_INDEX))
    _refuse_liger_loss_options(kwargs)
    has_labels = labels is not None or shift_labels is not None
    if skip_logits and not has_labels:
        raise ValueError(
            "liger-dspine: skip_logits=True needs labels or shift_labels: without them there is no loss to compute"
        )
    if has_labels:
        vocab = self.lm_head.weight.shape[0]
        if shift_labels is None:
            labels, labels_checked = checked_labels(labels, vocab, ignore_index, shifted=False)
        else:
            shift_labels, labels_checked = checked_labels(shift_labels, vocab, ignore_index)
    asked_fused, skip_logits = skip_logits is True, _fused_choice(self, fused, skip_logits, has_labels)

    input_ids, inputs_embeds = compiled_input_embeddings(self, input_ids, inputs_embeds)
    outputs = self.model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        inputs_embeds=inputs_embeds,
        use_cache=use_cache,
        **kwargs,
        **plain_causal_kwargs(self.config, attention_mask, position_ids, kwargs),
    )
    hidden_states = outputs.last_hidden_state
    if skip_logits:  # FSDP2 gathers a head grouped with the final norm when the norm runs: read it now
        skip_logits = _head_readable(self, asked_fused)
    if head_input is not None:
        hidden_states = head_input(self, hidden_states)
    hidden_states = _keep_positions(hidden_states, logits_to_keep)

    loss = logits = token_accuracy = None
    if has_labels:
        if shift_labels is None:
            labels = labels_checked(hidden_states)
        else:
            shift_labels = labels_checked(hidden_states)
        targets = _shifted_targets(labels, shift_labels, hidden_states, ignore_index)
        divisor = _loss_divisor(targets, kwargs.get("num_items_in_batch"), ignore_index)
    if skip_logits:
        fused_loss = _vocab_chunked_linear_ce if vocab_chunked else _fused_linear_ce

        def head_loss(hidden):  # reads the weight while the head's sharding hooks (if any) hold it gathered
            shard = vocab_shard(self.lm_head.weight)
            if shard is not None:  # tensor parallelism's vocabulary-sharded head
                return _vocab_parallel_linear_ce(hidden, shard, targets, divisor, ignore_index), None
            return fused_loss(hidden, self.lm_head.weight, targets, divisor, accum_dtype, ignore_index)

        if gathered_by_hooks(self.lm_head):  # FSDP2 or ZeRO-3 hooks on the head: run inside them
            loss, token_accuracy = call_through_hooks(self.lm_head, head_loss, hidden_states)
        else:
            loss, token_accuracy = head_loss(hidden_states)
    else:
        logits = self.lm_head(hidden_states)
        if has_labels:
            if fused:
                loss = self.loss_function(
                    logits=logits,
                    labels=labels,
                    shift_labels=None if shift_labels is None else shift_labels.contiguous(),  # the loss views it
                    vocab_size=self.config.vocab_size if vocab_size is None else vocab_size(self),
                    ignore_index=ignore_index,
                    **{**kwargs, "num_items_in_batch": divisor},  # sum / divisor
                )
            else:
                loss = _liger_ce(logits, targets, divisor, ignore_index)

    # a later backward pass that a kernel below cannot take is refused here, before any gradient changes
    loss, logits = refuse_later_passes(loss), refuse_later_passes(logits)
    output = output_class(loss=loss, logits=logits, token_accuracy=token_accuracy)
    for f in fields(output):
        if f.name not in ("loss", "logits", "token_accuracy") and f.name in outputs:
            setattr(output, f.name, outputs[f.name])
    return output if return_dict else _to_tuple(output)


def _fused_choice(model, fused: bool, skip_logits, has_labels: bool) -> bool:
    """Whether the loss skips the logits: ``skip_logits`` when given, else in training with labels; never for a head
    the fused loss would not compute (``head_checks.unfused_head_reason``)."""
    wanted = (fused and model.training and has_labels) if skip_logits is None else skip_logits
    if not wanted:
        return False
    return _fused_or_warn(unfused_head_reason(model.lm_head), skip_logits is True)


def _head_readable(model, asked_fused: bool) -> bool:
    """Whether the fused loss can read ``lm_head.weight`` as it stands after the model's body ran: whole, or
    vocabulary-parallel (``parallel_state.py``)."""
    return _fused_or_warn(sharded_head_reason(model.lm_head), asked_fused)


def _fused_or_warn(reason: str | None, asked_fused: bool) -> bool:
    if reason is None:
        return True
    if asked_fused:
        raise ValueError(
            f"liger-dspine: skip_logits=True, but {reason}: the fused linear cross entropy reads lm_head.weight "
            "without calling lm_head, so it would leave that out"
        )
    warnings.warn(
        f"liger-dspine: {reason}; the fused linear cross entropy reads lm_head.weight without calling lm_head, so "
        "the loss is computed from the head's logits instead",
        stacklevel=5,
    )
    return False


def _checked_ignore_index(ignore_index) -> int:
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"liger-dspine: ignore_index must be an int, got {ignore_index!r}")
    return ignore_index


def _refuse_liger_loss_options(kwargs: dict) -> None:
    """Take liger-kernel's loss keywords out of ``kwargs``; one that is not at its default is a ValueError."""
    for name, default in _LIGER_LOSS_DEFAULTS.items():
        value = kwargs.pop(name, default)
        if not (value is default or (default is not None and value == default)):
            shown = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
            raise ValueError(
                f"liger-dspine: {name}={shown} is one of liger-kernel's loss options that this forward does not "
                "compute (transformers' loss ignores it too); leave it at its default "
                f"({default!r}) or compute the loss from the returned logits"
            )


def _checked_accum_dtype(accum_dtype):
    """liger-kernel's ``accum_dtype`` keyword: the dtype the fused loss sums the head's gradient in (None: the
    weight's). Used by the fused loss only; the loss on logits leaves the head's gradient to autograd."""
    if accum_dtype is not None and not (isinstance(accum_dtype, torch.dtype) and accum_dtype.is_floating_point):
        raise TypeError(f"liger-dspine: accum_dtype must be a floating torch.dtype or None, got {accum_dtype!r}")
    return accum_dtype


def _to_tuple(output) -> tuple:
    """``to_tuple()`` that keeps the logits slot when logits are None; token_accuracy is the last field."""
    return tuple(
        getattr(output, f.name) for f in fields(output) if f.name == "logits" or getattr(output, f.name) is not None
    )


def _keep_positions(hidden_states: torch.Tensor, logits_to_keep) -> torch.Tensor:
    """The positions of ``hidden_states`` [B, S, H] that get logits, as the native forward selects them."""
    if _slice_logits_to_keep is not None:
        return _slice_logits_to_keep(hidden_states, logits_to_keep)
    if isinstance(logits_to_keep, int):
        return hidden_states[:, -logits_to_keep:, :] if logits_to_keep else hidden_states
    return hidden_states[:, logits_to_keep, :]


def _shifted_targets(labels, shift_labels, hidden_states, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Next-token targets aligned with ``hidden_states`` [B, S, H], flattened to [B*S]."""
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    if shift_labels.shape != hidden_states.shape[:-1]:
        raise ValueError(
            f"liger-dspine: labels of shape {tuple(shift_labels.shape)} do not match the hidden states "
            f"{tuple(hidden_states.shape[:-1])} they are the targets of (check logits_to_keep and shift_labels)"
        )
    return shift_labels.reshape(-1).to(hidden_states.device)


def _loss_divisor(targets: torch.Tensor, num_items_in_batch, ignore_index: int = IGNORE_INDEX) -> torch.Tensor | int:
    """``num_items_in_batch``, or the count of targets not ignored, as the loss divisor; at least 1, no host sync."""
    if num_items_in_batch is None:
        return (targets != ignore_index).sum().clamp(min=1)
    if isinstance(num_items_in_batch, torch.Tensor):
        return num_items_in_batch.clamp(min=1)
    return max(num_items_in_batch, 1)


# Transient logits of one chunk of liger-kernel's fused linear cross entropy. Its own rule (about tokens x hidden
# elements) cuts 4096 tokens at vocab 129280 / hidden 7168 into 16 chunks, each adding its share into the whole
# lm_head gradient (a read and a write of 1.7 GiB per chunk); with this floor they take 2 chunks.
FUSED_CE_CHUNK_BYTES = 512 * 2**20


def fused_ce_chunk_mem_const(tokens: int, hidden: int, element_size: int) -> int:
    """liger-kernel's ``chunk_mem_const``: its chunk budget is ``chunk_mem_const * tokens * hidden`` elements;
    raised (never lowered) so that a chunk's logits may take ``FUSED_CE_CHUNK_BYTES``."""
    return max(1, FUSED_CE_CHUNK_BYTES // max(1, tokens * hidden * element_size))


def _fused_linear_ce(hidden_states, weight, targets, divisor, accum_dtype=None, ignore_index=IGNORE_INDEX):
    from liger_dspine.ops.liger_kernel_ops import liger_fused_linear_cross_entropy

    check_kernel_device(hidden_states, "fused linear cross entropy")
    flat = hidden_states.reshape(-1, hidden_states.shape[-1])
    chunk_mem_const = fused_ce_chunk_mem_const(flat.shape[0], flat.shape[1], flat.element_size())
    loss, token_accuracy = liger_fused_linear_cross_entropy(
        flat, weight, targets, ignore_index, chunk_mem_const, accum_dtype
    )
    return loss / _on(divisor, loss), token_accuracy


def _vocab_chunked_linear_ce(hidden_states, weight, targets, divisor, accum_dtype=None, ignore_index=IGNORE_INDEX):
    # each vocabulary chunk's d weight is one GEMM accumulated in fp32, rounded once: any accum_dtype is met
    from liger_dspine.ops.linear_cross_entropy import liger_vocab_chunked_linear_cross_entropy

    check_kernel_device(hidden_states, "vocab-chunked linear cross entropy")
    loss, token_accuracy = liger_vocab_chunked_linear_cross_entropy(
        hidden_states.reshape(-1, hidden_states.shape[-1]),
        weight,
        targets,
        ignore_index=ignore_index,
        reduction="sum",
        return_token_accuracy=True,
    )
    return loss / _on(divisor, loss), token_accuracy


def _vocab_parallel_linear_ce(hidden_states, shard, targets, divisor, ignore_index=IGNORE_INDEX):
    from liger_dspine.ops.vocab_parallel_cross_entropy import liger_vocab_parallel_linear_cross_entropy

    loss = liger_vocab_parallel_linear_cross_entropy(
        hidden_states.reshape(-1, hidden_states.shape[-1]),
        shard.local_weight,
        targets,
        shard.vocab_start,
        shard.vocab_size,
        group=shard.group,
        ignore_index=ignore_index,
        reduction="sum",
    )
    return loss / _on(divisor, loss)


def _liger_ce(logits, targets, divisor, ignore_index=IGNORE_INDEX):
    from liger_kernel.transformers.functional import liger_cross_entropy

    check_kernel_device(logits, "Liger cross entropy")
    # The kernel writes the gradient into its input: give it an fp32 copy, never the logits returned to the caller.
    logits_fp32 = logits.reshape(-1, logits.shape[-1]).to(torch.float32, copy=True)
    guard = SecondPassGuard("liger-kernel's cross-entropy kernel")
    loss = guard.inner(liger_cross_entropy(logits_fp32, targets, ignore_index=ignore_index, reduction="sum"))
    return guard.outer(loss / _on(divisor, loss))


def _on(divisor, like: torch.Tensor):
    return divisor.to(like.device) if isinstance(divisor, torch.Tensor) else divisor
