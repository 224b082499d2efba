"""Whether a DSpine drafter can draft for a target: vocabulary, width, taps, mask token and transfer space."""

from torch import nn

from liger_dspine.models.dspine.capture import find_decoder


def check_drafter_fits_target(draft, target: nn.Module) -> nn.Module:
    """A ValueError naming what does not fit; returns the target's decoder (its ``layers`` and ``norm``)."""
    if not bool(draft.transfer_ready):
        raise ValueError(
            "liger-dspine: the drafter has no transfer space (transfer_ready is False): load a trained drafter, or "
            "call draft.initialize_transfer_space(target's lm_head weight) first"
        )
    vocab, hidden = draft.config.vocab_size, draft.config.hidden_size
    head = target.get_output_embeddings() if hasattr(target, "get_output_embeddings") else None
    embed = target.get_input_embeddings() if hasattr(target, "get_input_embeddings") else None
    for name, module in (("lm_head", head), ("input embedding", embed)):
        weight = getattr(module, "weight", None)
        if weight is None:
            raise ValueError(f"liger-dspine: the target {type(target).__name__} has no {name} for the drafter to use")
        if tuple(weight.shape) != (vocab, hidden):
            raise ValueError(
                f"liger-dspine: the target's {name} is {list(weight.shape)}, but the drafter was built for a target "
                f"with vocabulary {vocab} and hidden size {hidden} ([{vocab}, {hidden}])"
            )
    if getattr(head, "bias", None) is not None:
        raise ValueError("liger-dspine: the target's lm_head has a bias; DSpine drafts through a head without one")
    decoder = find_decoder(target)
    layers = len(decoder.layers)
    outside = [i for i in draft.target_layer_ids if not 0 <= i < layers]
    if outside:
        raise ValueError(
            f"liger-dspine: the drafter taps target layers {draft.target_layer_ids}, but the target has {layers} "
            f"layers ({outside} outside [0, {layers}))"
        )
    mask = draft.mask_token_id
    if mask is None or not 0 <= mask < vocab:
        raise ValueError(f"liger-dspine: the drafter's mask_token_id must be a token id in [0, {vocab}), got {mask!r}")
    draft_device, target_device = draft.fc.weight.device, head.weight.device
    if draft_device != target_device:
        raise ValueError(f"liger-dspine: the drafter is on {draft_device}, the target on {target_device}")
    return decoder
