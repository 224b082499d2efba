"""Target capture: what a DSpine objective needs from a frozen target, and nothing else.

:class:`TargetCapture` runs the target's decoder (its base model, never the LM head) under ``no_grad`` with forward
hooks on the tap layers and the final norm, so only those outputs are kept: no ``output_hidden_states``, no logits,
no KV cache. Its result is the objective's keyword arguments::

    capture = TargetCapture(target, draft.target_layer_ids)
    batch = capture(input_ids, loss_mask=loss_mask, position_ids=position_ids)
    out = objective(**batch, global_step=step, total_steps=total)

Tap id ``i`` is the output of decoder layer ``i`` (``output_hidden_states`` entry ``i + 1``). As in
``output_hidden_states``, the last layer's entry is the final-normed state, so a tap on the last layer returns it.
``target_last_hidden_states`` is what the target's head reads, so that ``lm_head`` of it gives the target's own logits:
the final-normed state, scaled where the target scales its logits (:mod:`~liger_dspine.models.dspine.head_input`,
checked once on a probe when the capture is built; a soft-capped head is refused).
"""

import torch
from torch import nn

from liger_dspine.models.dspine.head_input import probe_head_input
from liger_dspine.models.dspine.packing import document_ids_from_position_ids

# Where a causal LM keeps the module holding ``layers`` and ``norm`` (Llama, Qwen3, DeepSeek-V3 and its family:
# ``model``; a multimodal model such as Kimi-K2.5: ``model.language_model``), tried in order.
DECODER_PATHS = ("model", "model.language_model", "language_model", "language_model.model", "")


def find_decoder(target: nn.Module) -> nn.Module:
    """The submodule of ``target`` with a ``layers`` ModuleList and a final ``norm``; a ValueError when none."""
    for path in DECODER_PATHS:
        try:
            module = target.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(getattr(module, "layers", None), nn.ModuleList) and isinstance(
            getattr(module, "norm", None), nn.Module
        ):
            return module
    raise ValueError(
        f"liger-dspine: cannot find the decoder of {type(target).__name__}: none of "
        f"{[path or '<model>' for path in DECODER_PATHS]} has both `layers` (a ModuleList) and `norm`"
    )


def _first_tensor(output):
    return output[0] if isinstance(output, (tuple, list)) else output


class TargetCapture:
    """Captures a frozen causal LM's tap states [B, S, T*H] and the states its head reads [B, S, H].

    Args:
        target: a Hugging Face causal LM (patched by this package or not); it is put in eval mode and frozen, and run
            once on a short probe to find what its head reads.
        target_layer_ids: 0-based decoder layers, concatenated in this order (the drafter's ``target_layer_ids``).

    Attributes:
        head_input: the rule from the final-normed state to the head's input (the identity for most targets).
        kept: how many tensors the hooks kept during the last call (distinct taps, plus the final norm).
    """

    def __init__(self, target: nn.Module, target_layer_ids: list[int]):
        self.target = target.eval().requires_grad_(False)
        self.decoder = find_decoder(target)
        num_layers = len(self.decoder.layers)
        ids = list(target_layer_ids)
        if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in ids):
            raise ValueError(
                f"liger-dspine: target_layer_ids must be a non-empty list of layer indices in [0, {num_layers}), "
                f"got {target_layer_ids}"
            )
        self.target_layer_ids = ids
        self.last_layer = num_layers - 1
        self.head_input = probe_head_input(self.target, self.decoder)
        self.kept = 0

    @torch.no_grad()
    def __call__(
        self,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """
        Args:
            input_ids: [B, S] long.
            loss_mask: [B, S] (> 0.5 where supervised); None supervises every token (or the attention mask's).
            position_ids: [B, S] long; positions restarting inside a row mark packed documents. They go to the
                target (whose attention then stays inside each document) and become ``document_ids``.
            attention_mask: [B, S] padding mask, passed to the target (leave it None with packing).

        Returns:
            The objective's inputs: ``input_ids``, ``hidden_states`` [B, S, T*H], ``loss_mask`` [B, S] float,
            ``target_last_hidden_states`` [B, S, H] (the head's input), and ``document_ids`` [B, S] when
            ``position_ids`` is given.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"liger-dspine: input_ids must be [B, S], got shape {tuple(input_ids.shape)}")
        optional = {"loss_mask": loss_mask, "position_ids": position_ids, "attention_mask": attention_mask}
        for name, value in optional.items():
            if value is not None and tuple(value.shape) != tuple(input_ids.shape):
                raise ValueError(
                    f"liger-dspine: {name} must have the shape of input_ids {tuple(input_ids.shape)}, "
                    f"got {tuple(value.shape)}"
                )
        kept: dict = {}

        def keep(key):
            def hook(module, args, output):
                kept[key] = _first_tensor(output)

            return hook

        taps = sorted(set(i for i in self.target_layer_ids if i != self.last_layer))
        handles = [self.decoder.layers[i].register_forward_hook(keep(i)) for i in taps]
        handles.append(self.decoder.norm.register_forward_hook(keep("norm")))
        try:
            self.decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        finally:
            for handle in handles:
                handle.remove()
        self.kept = len(kept)
        final = kept.pop("norm")
        kept[self.last_layer] = final  # output_hidden_states' last entry is the normed state
        if loss_mask is None:
            loss_mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        batch = dict(
            input_ids=input_ids,
            hidden_states=torch.cat([kept[i] for i in self.target_layer_ids], dim=-1),
            loss_mask=loss_mask.float(),
            target_last_hidden_states=self.head_input(final),
        )
        if position_ids is not None:
            batch["document_ids"] = document_ids_from_position_ids(position_ids)
        return batch
