"""The spine's adjacent injection with memory-lean writes and features (the ``injection`` option of the patch).

Same parameters and numbers as :class:`AdjacentInjection`; per decoder layer it keeps three [B, N*b, H] buffers
fewer for the backward (the fp32 copy of the states for their RMS and the written delta), and the features keep
their bf16 projection instead of an fp32 copy (see :mod:`liger_dspine.ops.scaled_write`). A readout or write that
is not a plain ``nn.Linear`` (LoRA, hooks) runs through the native code.
"""

import torch

from liger_dspine.models.dspine.injection import AdjacentInjection
from liger_dspine.modules.config_reading import runs_plain_linear
from liger_dspine.ops.scaled_write import liger_scaled_write
from liger_dspine.ops.scaled_write import liger_unit_feature


class LigerAdjacentInjection(AdjacentInjection):
    """:class:`AdjacentInjection` whose ``feature`` and ``write`` keep less for the backward."""

    def feature(self, states: torch.Tensor, layer: int) -> torch.Tensor:
        readout = self.readouts[layer]
        if not runs_plain_linear(readout):
            return super().feature(states, layer)
        return liger_unit_feature(readout(states), self.code_scale, 1e-12)

    def write(
        self, states: torch.Tensor, receiver: torch.Tensor, predecessor: torch.Tensor, layer: int
    ) -> torch.Tensor:
        write = self.writes[layer]
        if not runs_plain_linear(write) or write.bias is not None:
            return super().write(states, receiver, predecessor, layer)
        predecessor = predecessor.to(receiver.dtype)
        gate = torch.sigmoid(self.receiver_gate(receiver) + self.predecessor_gate(predecessor) + self.bias)
        return liger_scaled_write(states, gate * self.message(predecessor), write.weight)
