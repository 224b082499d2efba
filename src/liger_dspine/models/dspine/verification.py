"""Speculative decoding's two halves for one block: sampling the drafts, and the target's verification.

Greedy (temperature 0): keep the longest prefix of proposals equal to the target's argmax tokens, then the target's
own next token; the output is the target's greedy decoding. Sampled (temperature T > 0): the proposals are drawn from
the draft distributions q, proposal i is kept with probability min(1, p_i(x_i) / q_i(x_i)) until the first rejection,
whose replacement is drawn from max(0, p - q) renormalised (from p when every proposal is kept), p = softmax(target
logits / T): each emitted token is distributed as the target's own sample (Leviathan et al. 2023, algorithm 1).
"""

import torch


def greedy_acceptance(proposals: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """proposals [P] long, target_logits [P+1, V] (row j scores the token after block slot j) -> (accepted
    proposals, the target's next token)."""
    target_tokens = target_logits.argmax(dim=-1)
    accepted = int((proposals == target_tokens[:-1]).long().cumprod(dim=0).sum())
    return accepted, int(target_tokens[accepted])


def tempered_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / temperature) in fp32."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def sample_plain_drafts(logits: torch.Tensor, temperature: float, generator=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each slot drawn from softmax(drafter logits / T): logits [P, V] -> (proposals [P] long, q [P, V])."""
    probs = tempered_probs(logits, temperature)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1), probs


def sample_refined_drafts(
    scores: torch.Tensor, candidate_ids: torch.Tensor, vocab_size: int, temperature: float, generator=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot by slot, a candidate drawn from softmax(transition scores / T) under the previous slot's draw.

    Args:
        scores: [P, K, K] (row k: predecessor candidate k of the previous slot); candidate_ids: [P, K].

    Returns:
        proposals [P] long and q [P, V] (zero outside each slot's candidates).
    """
    slots, top_k = candidate_ids.shape
    probs = torch.zeros(slots, vocab_size, dtype=torch.float32, device=scores.device)
    chosen = torch.zeros(slots, dtype=torch.long, device=scores.device)
    row = 0
    for slot in range(slots):
        slot_probs = tempered_probs(scores[slot, row], temperature)  # [K]
        row = int(torch.multinomial(slot_probs, 1, generator=generator))
        probs[slot].scatter_(0, candidate_ids[slot], slot_probs)
        chosen[slot] = candidate_ids[slot, row]
    return chosen, probs


def sampled_acceptance(
    proposals: torch.Tensor, draft_probs: torch.Tensor, target_logits: torch.Tensor, temperature: float, generator=None
) -> tuple[int, int]:
    """proposals [P] drawn from draft_probs [P, V]; target_logits [P+1, V] -> (accepted proposals, next token)."""
    slots = proposals.shape[0]
    target_probs = tempered_probs(target_logits, temperature)  # [P+1, V]
    rows = torch.arange(slots, device=proposals.device)
    ratio = target_probs[rows, proposals] / draft_probs[rows, proposals]
    draws = torch.rand(slots, generator=generator, device=proposals.device)
    accepted = int((draws < ratio).long().cumprod(dim=0).sum())
    distribution = target_probs[accepted]
    if accepted < slots:
        residual = (target_probs[accepted] - draft_probs[accepted]).clamp_min(0.0)
        total = residual.sum()
        if total > 0:
            distribution = residual / total
    return accepted, int(torch.multinomial(distribution, 1, generator=generator))
