"""The target's taps of every forward run inside a :class:`TapRecorder`, with or without a KV cache.

Tap id ``i`` is the output of decoder layer ``i``; a tap on the last layer is the final-normed state, as in
``output_hidden_states`` (and :class:`~liger_dspine.models.dspine.capture.TargetCapture`, which the drafter was trained
from).
"""

import torch
from torch import nn


def _first_tensor(output):
    return output[0] if isinstance(output, (tuple, list)) else output


class TapRecorder:
    """Forward hooks on the tap layers (and the final norm) of ``decoder`` while inside ``with``.

    Args:
        decoder: the module holding the target's ``layers`` and final ``norm``.
        target_layer_ids: the drafter's taps, concatenated in this order.
    """

    def __init__(self, decoder: nn.Module, target_layer_ids: list[int]):
        self.decoder = decoder
        self.target_layer_ids = list(target_layer_ids)
        self.last_layer = len(decoder.layers) - 1
        self._kept: dict = {}
        self._handles: list = []

    def _keep(self, key):
        def hook(module, args, output):
            self._kept[key] = _first_tensor(output)

        return hook

    def __enter__(self) -> "TapRecorder":
        layers = sorted(set(i for i in self.target_layer_ids if i != self.last_layer))
        self._handles = [self.decoder.layers[i].register_forward_hook(self._keep(i)) for i in layers]
        if self.last_layer in self.target_layer_ids:
            self._handles.append(self.decoder.norm.register_forward_hook(self._keep(self.last_layer)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def taps(self) -> torch.Tensor:
        """[B, S, T*H]: the taps of the last forward (its S new positions), then forgotten."""
        missing = [i for i in self.target_layer_ids if i not in self._kept]
        if missing:
            raise RuntimeError(f"liger-dspine: the target's last forward did not run its layers {missing}")
        taps = torch.cat([self._kept[i] for i in self.target_layer_ids], dim=-1)
        self._kept = {}
        return taps
