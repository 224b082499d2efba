"""The DSpine spine: adjacent injection between draft slots, and the fixed transfer space it writes in.

After every decoder layer l, proposal slot j of a block receives a gated message from its predecessor: the
anchor token's code for j = 1, otherwise the readout feature of slot j-1's state at the same layer. Features and
codes live in an r-dimensional "transfer space" derived once from the target's frozen lm_head.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as hf_init


class AdjacentInjection(nn.Module):
    """Per-layer readouts and writes, with a message and two gates shared by all layers.

    Args:
        hidden_size: H, width of the draft stream.
        num_layers: L, one readout and one write per decoder layer.
        transfer_rank: r, width of the transfer space and of every readout.
        message_size: m, width of the gated message.
        replacement_layers: layers l < replacement_layers use teacher-forced predecessors when asked.
    """

    def __init__(
        self, hidden_size: int, num_layers: int, transfer_rank: int, message_size: int, replacement_layers: int
    ):
        super().__init__()
        self.hidden_size = hidden_size
        self.rank = transfer_rank
        self.replacement_layers = replacement_layers
        self.readouts = nn.ModuleList(nn.Linear(hidden_size, transfer_rank, bias=False) for _ in range(num_layers))
        self.writes = nn.ModuleList(nn.Linear(message_size, hidden_size, bias=False) for _ in range(num_layers))
        self.message = nn.Linear(transfer_rank, message_size, bias=False)
        self.receiver_gate = nn.Linear(transfer_rank, message_size, bias=False)
        self.predecessor_gate = nn.Linear(transfer_rank, message_size, bias=False)
        self.bias = nn.Parameter(torch.zeros(message_size))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Zero writes, predecessor gate and bias (a fresh spine is the identity); PyTorch default init elsewhere.

        Uses transformers' guarded init functions, so tensors loaded from a checkpoint are left alone.
        """
        for linear in (*self.readouts, self.message, self.receiver_gate):
            hf_init.kaiming_uniform_(linear.weight, a=math.sqrt(5))
        for linear in (*self.writes, self.predecessor_gate):
            hf_init.zeros_(linear.weight)
        hf_init.zeros_(self.bias)

    @property
    def code_scale(self) -> float:
        return math.sqrt(self.rank)

    def feature(self, states: torch.Tensor, layer: int) -> torch.Tensor:
        """[..., H] -> [..., r]: sqrt(r) * L2-normalised readout (normalised in fp32, cast back)."""
        projected = self.readouts[layer](states)
        return (self.code_scale * F.normalize(projected.float(), dim=-1, eps=1e-12)).to(states.dtype)

    def write(
        self, states: torch.Tensor, receiver: torch.Tensor, predecessor: torch.Tensor, layer: int
    ) -> torch.Tensor:
        """states + RMS(states) * writes[layer](gate * message(predecessor)).

        Args:
            states: [..., H] the receiving slots' pre-injection states.
            receiver: [..., r] their features.
            predecessor: [..., r] predecessor vectors (cast to the receiver's dtype).
        """
        predecessor = predecessor.to(receiver.dtype)
        gate = torch.sigmoid(self.receiver_gate(receiver) + self.predecessor_gate(predecessor) + self.bias)
        delta = self.writes[layer](gate * self.message(predecessor))
        # RMS without eps; the norm's gradient at zero is zero, so zero states stay finite.
        scale = torch.linalg.vector_norm(states.float(), dim=-1, keepdim=True) / math.sqrt(self.hidden_size)
        return states + scale.to(states.dtype) * delta

    def token_codes(self, token_ids: torch.Tensor, transfer_codes: torch.Tensor) -> torch.Tensor:
        """sqrt(r) * transfer_codes[token_ids]: [...] -> [..., r] in the codes' dtype."""
        return self.code_scale * transfer_codes[token_ids]

    def forward(
        self,
        states: torch.Tensor,
        layer: int,
        block_token_ids: torch.Tensor,
        transfer_codes: torch.Tensor,
        replace_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inject along the slots of every block.

        Args:
            states: [B, N, b, H] pre-injection states of layer ``layer``.
            block_token_ids: [B, N, b] long, anchor then ground-truth continuations.
            transfer_codes: [V, r] unit-norm token codes.
            replace_mask: [B, N] bool or None; replaced blocks take ground-truth predecessors when
                ``layer < replacement_layers``.

        Returns:
            post: [B, N, b, H] post-injection states (slot 0 unchanged).
            post_features: [B, N, b, r] ``feature(post, layer)``.
        """
        features = self.feature(states, layer)
        anchor_code = self.token_codes(block_token_ids[..., :1], transfer_codes).to(features.dtype)
        predecessors = torch.cat([anchor_code, features[..., 1:-1, :]], dim=-2)  # [B, N, P, r]
        if replace_mask is not None and layer < self.replacement_layers:
            forced = self.token_codes(block_token_ids[..., :-1], transfer_codes).to(features.dtype)
            predecessors = torch.where(replace_mask[:, :, None, None], forced, predecessors)
        written = self.write(states[..., 1:, :], features[..., 1:, :], predecessors, layer)
        post = torch.cat([states[..., :1, :], written], dim=-2)
        return post, self.feature(post, layer)


@torch.no_grad()
def compute_transfer_space(
    head_weight: torch.Tensor, rank: int, chunk_size: int = 4096
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token codes and readout basis from the frozen lm_head rows (all fp32, streamed over row chunks).

    With u_i the L2-normalised rows, mu their mean and C = sum_i (u_i - mu)(u_i - mu)^T, the top-r eigenpairs
    (lambda, E) of C (ascending order kept) give code_i = normalize(((u_i - mu) E) / sqrt(lambda)).

    Args:
        head_weight: [V, H] the target's lm_head weight.
        rank: r.

    Returns:
        codes: [V, r] fp32 unit vectors.
        basis: [H, r] fp32 E_top; every readout is initialised to basis^T.
    """
    if chunk_size < 1:
        raise ValueError(f"DSpine transfer space chunk_size must be >= 1, got {chunk_size}")
    vocab, hidden = head_weight.shape
    device = head_weight.device

    def unit_rows(start: int) -> torch.Tensor:
        rows = head_weight[start : start + chunk_size].float()
        return rows / rows.norm(dim=-1, keepdim=True).clamp_min(1e-12)

    total = torch.zeros(hidden, dtype=torch.float32, device=device)
    gram = torch.zeros(hidden, hidden, dtype=torch.float32, device=device)
    for start in range(0, vocab, chunk_size):
        rows = unit_rows(start)
        total += rows.sum(dim=0)
        gram += rows.T @ rows
    mean = total / vocab
    covariance = gram - vocab * torch.outer(mean, mean)
    eigenvalues, eigenvectors = torch.linalg.eigh(covariance)
    top_values, basis = eigenvalues[-rank:], eigenvectors[:, -rank:]
    if not bool(torch.isfinite(top_values).all()) or bool((top_values <= 0).any()):
        raise ValueError(
            f"DSpine transfer space: insufficient positive principal directions in lm_head for transfer_rank={rank}"
        )
    whitening = basis / top_values.sqrt()  # [H, r]
    codes = torch.empty(vocab, rank, dtype=torch.float32, device=device)
    for start in range(0, vocab, chunk_size):
        rows = unit_rows(start)
        codes[start : start + rows.shape[0]] = F.normalize((rows - mean) @ whitening, dim=-1)
    return codes, basis
