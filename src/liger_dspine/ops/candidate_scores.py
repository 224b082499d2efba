"""Scores of gathered head rows: s[n, k] = W[ids[n, k]] . h[n] in fp32, without keeping the gathered rows.

The DSpine refinement loss scores each proposal's K candidates against its refined state. Written as
``W[ids].float() @ h`` it materialises [N, K, H] fp32 (about 880 MB for 1920 rows, K = 16, H = 7168) and autograd
keeps it for the backward. Here rows go in blocks whose gathered rows fit ``block_bytes``, and the backward gathers
them again: it needs only W (frozen: it gets no gradient) and the ids, dh[n] = sum_k ds[n, k] W[ids[n, k]].
Both directions compute in fp32, as the eager expression does; dh is returned in h's dtype.
"""

import torch

DEFAULT_BLOCK_BYTES = 128 * 2**20


def _blocks(rows: int, top_k: int, hidden: int, block_bytes: int):
    step = max(1, block_bytes // max(1, top_k * hidden * 4))
    for start in range(0, rows, step):
        yield start, min(start + step, rows)


class LigerCandidateScoresFunction(torch.autograd.Function):
    """``(h [N, H], W [V, H], ids [N, K], block_bytes)`` -> scores [N, K] fp32; differentiable in h only."""

    @staticmethod
    def forward(ctx, hidden, weight, ids, block_bytes):
        rows, top_k = ids.shape
        scores = torch.empty(rows, top_k, dtype=torch.float32, device=hidden.device)
        for start, end in _blocks(rows, top_k, weight.shape[1], block_bytes):
            gathered = weight[ids[start:end]].float()  # [b, K, H]
            scores[start:end] = torch.bmm(gathered, hidden[start:end].float().unsqueeze(-1)).squeeze(-1)
        ctx.save_for_backward(weight, ids)
        ctx.block_bytes = block_bytes
        ctx.hidden_dtype = hidden.dtype
        return scores

    @staticmethod
    def backward(ctx, grad_scores):
        weight, ids = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        rows, top_k = ids.shape
        grad_scores = grad_scores.float()
        grad_hidden = torch.empty(rows, weight.shape[1], dtype=ctx.hidden_dtype, device=grad_scores.device)
        for start, end in _blocks(rows, top_k, weight.shape[1], ctx.block_bytes):
            gathered = weight[ids[start:end]].float()
            grad_hidden[start:end] = torch.bmm(grad_scores[start:end].unsqueeze(1), gathered).squeeze(1)
        return grad_hidden, None, None, None


def liger_candidate_scores(
    hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, *, block_bytes: int = DEFAULT_BLOCK_BYTES
) -> torch.Tensor:
    """s[..., k] = W[ids[..., k]] . h[...] in fp32.

    Args:
        hidden: [..., H] rows (any float dtype).
        weight: [V, H] a frozen head (must not require grad while autograd is on).
        ids: [..., K] long, in [0, V).
        block_bytes: bound of the gathered fp32 rows held at once.

    Returns:
        [..., K] fp32.
    """
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1] or ids.shape[:-1] != hidden.shape[:-1]:
        raise ValueError(
            f"liger-dspine: candidate scores expect rows [..., H], a head [V, H] and ids [..., K], got "
            f"{tuple(hidden.shape)}, {tuple(weight.shape)} and {tuple(ids.shape)}"
        )
    if torch.is_grad_enabled() and weight.requires_grad:
        raise ValueError("liger-dspine: candidate scores give the head no gradient; freeze it")
    lead = ids.shape[:-1]
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_ids = ids.reshape(-1, ids.shape[-1])
    scores = LigerCandidateScoresFunction.apply(flat_hidden, weight, flat_ids, int(block_bytes))
    return scores.view(*lead, ids.shape[-1])
