"""DeepSeek-family MoE router: grouped top-k expert selection fused into one Triton kernel per direction.

The router GEMM stays in torch (cuBLAS); these kernels replace the dozen small kernels of the selection:
score function, bias for choice, per-group scores, top ``topk_group`` groups, group mask, top-k experts, gather,
renormalisation and scaling, and in the backward the gather / division / score-function gradients and the scatter.

Selection, per token row of ``router_logits [T, E]`` (fp32):
    scores = score_func(logits): "sigmoid" (DeepSeek-V3), "softmax" over the row (DeepSeek-V2, Mistral-Small-4) or
        "sqrtsoftplus", sqrt(softplus(logits)) with torch's softplus threshold of 20 (DeepSeek-V4)
    choice = scores + bias (the optional correction bias; without one, choice = scores)
    group score of each of ``n_group`` groups of ``E / n_group`` experts: "top2" the sum of its two largest
        ``choice`` (DeepSeek-V3, Mistral-Small-4), "max" its largest (DeepSeek-V2's "group_limited_greedy")
    keep the ``topk_group`` best groups; take the ``top_k`` best ``choice`` among their experts
    weights = scores at those experts [/ (sum + 1e-20) when ``norm_topk_prob``] * routed_scaling_factor
Greedy selection (DeepSeek-V2's "greedy") is one group: ``n_group = topk_group = 1``.

Any expert count, ``n_group`` dividing it into groups (of at least 2 for "top2"), ``1 <= topk_group <= n_group``
and ``1 <= top_k <= topk_group * group size`` (others are refused; transformers fails on them or, for a larger
``top_k``, fills the top-k with experts of the dropped groups, whose masked scores tie, in ``torch.topk``'s tie
order: ``masked_topk_reason`` names that layout, and the router modules compute it with transformers' own routing).
Group and slot axes are padded to powers of two inside the kernel; padding slots never alias a real expert. The
softmax backward needs every expert's score: it keeps the logits (the router GEMM's output, alive anyway) and one
log-sum-exp per row, and recomputes them.

Ties. The ``top_k`` entries of a row are ordered by ``choice`` (biased score), largest first. On an exact tie, of
group scores or of ``choice``, the lower group or expert index is taken first. transformers' ``topk(sorted=False)``
leaves both the order and the tie winner unspecified (on a CPU it takes the higher index), so on exact ties the
chosen experts may differ from native ones; their weights differ only when the tied experts' scores differ
(equal ``choice`` through different biases). Consumers combine experts by weight, so the order does not matter.
DeepSeek-V2 and Mistral-Small-4 give the dropped groups' experts a score of 0 (not -inf) before the top-k: a kept
expert whose softmax score underflows to 0 ties with them there; the kernel never picks a dropped group's expert.

NaN. With "softmax" a NaN logit makes its whole row NaN (scores, weights and gradients), as natively; what follows
is about "sigmoid" and "sqrtsoftplus". A NaN ``choice`` ranks above every number, as in ``torch.topk``: a group
holding one is kept first and its NaN experts are chosen first (lower index first). So a row holding a NaN gives NaN
weights, all of them with ``norm_topk_prob`` and those of the NaN experts without, as transformers does; the indices
equal native ones as long as the NaN experts and groups fit in ``top_k`` and ``topk_group`` (beyond that native's
pick among NaNs is unspecified). The logits' gradient is NaN at the chosen NaN experts (and at every chosen expert with
``norm_topk_prob``), as natively. Natively it is NaN at every NaN logit too (0 times the sigmoid's NaN derivative);
the kernel keeps a NaN count per row, not their places, so a row with NaN logits left unchosen gets a NaN gradient
over the whole row: exactly native's for a NaN token (every logit NaN), and NaN wherever native's is otherwise. The
hidden states' and router weight's gradients then equal native ones, NaN included, for NaN tokens; a NaN never turns
into a finite number.

The bias gets no gradient and the indices are not differentiable, as in transformers.
"""

import torch
import triton
import triton.language as tl

from liger_dspine._interpreter import check_kernel_device
from liger_dspine.ops.eager_dispatch import liger_custom_op
from liger_dspine.ops.first_order import first_order_only

_FORWARD_TILE = 2048  # logits per program in the forward (tokens x padded experts)
_BACKWARD_TILE = 4096  # gradient entries per program in the backward
_MAX_TOKENS_PER_PROGRAM = 64


@triton.jit
def _sqrt_softplus(x):
    """sqrt(softplus(x)) as torch computes it in fp32 (x above 20 is kept), softplus = max(x, 0) + log1p(exp(-|x|)),
    with log1p(u) = log(w) * u / (w - 1), w = 1 + u rounded: accurate where log(1 + u) would lose u's digits."""
    small = tl.exp(-tl.abs(x))
    shifted = 1.0 + small
    log1p = tl.where(shifted == 1.0, small, tl.log(shifted) * small / tl.maximum(shifted - 1.0, 1e-30))
    softplus = tl.where(x > 20.0, x, tl.maximum(x, 0.0) + log1p)
    return tl.sqrt(softplus)


@triton.jit
def _sqrt_softplus_derivative(score):
    """d sqrt(softplus(z)) / dz from s = sqrt(softplus(z)): sigmoid(z) / (2 s), with sigmoid(z) = 1 - exp(-s^2)
    (a series where s^2 is small, which also gives the limit 0 at s = 0)."""
    square = score * score
    series = 1.0 - square * (0.5 - square * (1.0 / 6.0 - square * (1.0 / 24.0)))  # (1 - exp(-x)) / x
    # (the maximum only keeps the unused lanes of the division finite: where it is used, score > 0.3)
    return tl.where(square < 0.1, 0.5 * score * series, (1.0 - tl.exp(-square)) / tl.maximum(2.0 * score, 0.5))


@triton.jit
def _moe_router_forward_kernel(
    logits_ptr,  # [T, E] fp32
    bias_ptr,  # [E] fp32
    weights_ptr,  # [T, K] fp32 out
    indices_ptr,  # [T, K] int64 out
    topk_scores_ptr,  # [T, K] fp32 out: sigmoid scores of the chosen experts, kept for the backward
    nan_counts_ptr,  # [T] int32 out: NaN logits of each row, kept for the backward
    row_lse_ptr,  # [T] fp32 out: log-sum-exp of each row, kept for the softmax backward
    num_tokens,
    scaling,
    NUM_EXPERTS: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    TOP_K: tl.constexpr,
    NORMALIZE: tl.constexpr,
    SOFTMAX: tl.constexpr,  # scores: softmax over the row
    SQRT_SOFTPLUS: tl.constexpr,  # scores: sqrt(softplus) (neither: sigmoid)
    GROUP_MAX: tl.constexpr,  # group score: the largest choice (else the sum of the two largest)
    HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < num_tokens
    rows = rows.to(tl.int64)
    groups = tl.arange(0, BLOCK_G)
    slots = tl.arange(0, BLOCK_S)
    # Experts laid out as [group, slot in group]: expert id = group * GROUP_SIZE + slot. Padding slots (a group
    # size or group count that is not a power of two) get id -1, so that none aliases the next group's experts.
    expert_ok = (groups[:, None] < NUM_GROUPS) & (slots[None, :] < GROUP_SIZE)
    expert = tl.where(expert_ok, groups[:, None] * GROUP_SIZE + slots[None, :], -1)

    offsets = rows[:, None, None] * NUM_EXPERTS + expert[None, :, :]
    load_mask = row_ok[:, None, None] & expert_ok[None, :, :]
    logits = tl.load(logits_ptr + offsets, mask=load_mask, other=0.0)
    if SOFTMAX:
        # as torch's softmax: exp(x - max) / sum; a NaN logit makes the sum, so the whole row, NaN
        shifted = tl.where(expert_ok[None, :, :], logits, float("-inf"))
        row_max = tl.max(tl.max(shifted, axis=2), axis=1)
        exps = tl.exp(shifted - row_max[:, None, None])
        row_sum = tl.sum(tl.sum(exps, axis=2), axis=1)
        scores = exps / row_sum[:, None, None]
        tl.store(row_lse_ptr + rows, row_max + tl.log(row_sum), mask=row_ok)
    elif SQRT_SOFTPLUS:
        scores = _sqrt_softplus(logits)
    else:
        scores = 1.0 / (1.0 + tl.exp(-logits))  # [BLOCK_T, BLOCK_G, BLOCK_S]
    scores = tl.where(expert_ok[None, :, :], scores, 0.0)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert, mask=expert_ok, other=0.0)
        choice = scores + bias[None, :, :]
    else:
        choice = scores
    # NaN ranks above every number, as in torch.topk; the comparisons below then never meet a NaN.
    choice = tl.where(choice != choice, float("inf"), choice)
    choice = tl.where(expert_ok[None, :, :], choice, float("-inf"))  # padding never counts in a group score

    # Group score: the largest, plus the second largest for "top2" (one occurrence of the largest removed, so ties
    # count twice).
    first = tl.max(choice, axis=2)
    if GROUP_MAX:
        group_score = first  # [BLOCK_T, BLOCK_G]
    else:
        first_slot = tl.min(tl.where(choice == first[:, :, None], slots[None, None, :], BLOCK_S), axis=2)
        second = tl.max(tl.where(slots[None, None, :] == first_slot[:, :, None], float("-inf"), choice), axis=2)
        group_score = first + second  # [BLOCK_T, BLOCK_G]
    group_score = tl.where(group_score != group_score, float("inf"), group_score)  # +inf + -inf (a -inf bias)

    # Each pass takes the best group still free, the lower index on ties; a -inf score is taken like any other.
    group_free = tl.broadcast_to((groups < NUM_GROUPS)[None, :], (BLOCK_T, BLOCK_G))
    for _ in tl.static_range(TOPK_GROUP):
        best = tl.max(tl.where(group_free, group_score, float("-inf")), axis=1)
        at_best = group_free & (group_score == best[:, None])
        best_group = tl.min(tl.where(at_best, groups[None, :], BLOCK_G), axis=1)
        group_free = group_free & (groups[None, :] != best_group[:, None])
    kept = (groups < NUM_GROUPS)[None, :] & ~group_free  # [BLOCK_T, BLOCK_G]

    # Then the top_k best experts of the kept groups, one at a time, the lower index on ties.
    free = kept[:, :, None] & expert_ok[None, :, :]
    k_cols = tl.arange(0, BLOCK_K)
    topk_scores = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    topk_indices = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(tl.max(tl.where(free, choice, float("-inf")), axis=2), axis=1)
        at_best = free & (choice == best[:, None, None])
        best_expert = tl.min(tl.min(tl.where(at_best, expert[None, :, :], NUM_EXPERTS), axis=2), axis=1)
        hit = expert[None, :, :] == best_expert[:, None, None]
        score = tl.sum(tl.sum(tl.where(hit, scores, 0.0), axis=2), axis=1)
        free = free & ~hit
        topk_scores = tl.where(k_cols[None, :] == k, score[:, None], topk_scores)
        topk_indices = tl.where(k_cols[None, :] == k, best_expert[:, None], topk_indices)

    if NORMALIZE:
        weights = topk_scores / (tl.sum(topk_scores, axis=1)[:, None] + 1e-20)
    else:
        weights = topk_scores
    weights = weights * scaling

    out_offsets = rows[:, None] * TOP_K + k_cols[None, :]
    out_mask = row_ok[:, None] & (k_cols[None, :] < TOP_K)
    tl.store(weights_ptr + out_offsets, weights, mask=out_mask)
    tl.store(indices_ptr + out_offsets, topk_indices.to(tl.int64), mask=out_mask)
    tl.store(topk_scores_ptr + out_offsets, topk_scores, mask=out_mask)
    nan_counts = tl.sum(tl.sum((logits != logits).to(tl.int32), axis=2), axis=1)
    tl.store(nan_counts_ptr + rows, nan_counts, mask=row_ok)


@triton.jit
def _moe_router_backward_kernel(
    grad_weights_ptr,  # [T, K] fp32
    topk_scores_ptr,  # [T, K] fp32
    indices_ptr,  # [T, K] int64
    nan_counts_ptr,  # [T] int32
    logits_ptr,  # [T, E] fp32: read by the softmax backward only
    row_lse_ptr,  # [T] fp32: read by the softmax backward only
    grad_logits_ptr,  # [T, E] fp32 out, written densely (sigmoid: zeros off the chosen experts)
    num_tokens,
    scaling,
    NUM_EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr,
    NORMALIZE: tl.constexpr,
    SOFTMAX: tl.constexpr,
    SQRT_SOFTPLUS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < num_tokens
    rows = rows.to(tl.int64)
    k_cols = tl.arange(0, BLOCK_K)
    k_offsets = rows[:, None] * TOP_K + k_cols[None, :]
    k_mask = row_ok[:, None] & (k_cols[None, :] < TOP_K)
    grad_weights = tl.load(grad_weights_ptr + k_offsets, mask=k_mask, other=0.0)
    scores = tl.load(topk_scores_ptr + k_offsets, mask=k_mask, other=0.0)
    indices = tl.load(indices_ptr + k_offsets, mask=k_mask, other=-1).to(tl.int32)

    if NORMALIZE:
        # w_k = r * s_k / D, D = sum(s) + eps:  dL/ds_j = r / D * (g_j - sum_k g_k * s_k / D)
        denominator = tl.sum(scores, axis=1) + 1e-20
        projection = tl.sum(grad_weights * scores, axis=1) / denominator
        grad_scores = (grad_weights - projection[:, None]) * (scaling / denominator[:, None])
    else:
        grad_scores = grad_weights * scaling
    if SOFTMAX:
        grad_chosen = grad_scores
    elif SQRT_SOFTPLUS:
        grad_chosen = grad_scores * _sqrt_softplus_derivative(scores)
    else:
        grad_chosen = grad_scores * scores * (1.0 - scores)  # through the sigmoid

    experts = tl.arange(0, BLOCK_E)
    grad_logits = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        column = k_cols[None, :] == k
        expert_k = tl.sum(tl.where(column, indices, 0), axis=1)
        grad_k = tl.sum(tl.where(column, grad_chosen, 0.0), axis=1)
        grad_logits = tl.where(experts[None, :] == expert_k[:, None], grad_k[:, None], grad_logits)
    out_offsets = rows[:, None] * NUM_EXPERTS + experts[None, :]
    out_mask = row_ok[:, None] & (experts[None, :] < NUM_EXPERTS)
    if SOFTMAX:
        # through the softmax, every expert: dL/dz_j = s_j * (dL/ds_j - sum_k dL/ds_k * s_k), s_j recomputed
        logits = tl.load(logits_ptr + out_offsets, mask=out_mask, other=float("-inf"))
        row_lse = tl.load(row_lse_ptr + rows, mask=row_ok, other=0.0)
        all_scores = tl.exp(logits - row_lse[:, None])
        projection = tl.sum(grad_logits * all_scores, axis=1)
        grad_logits = all_scores * (grad_logits - projection[:, None])
    # A row with NaN logits left unchosen: native's gradient is NaN there (0 times the sigmoid's NaN derivative).
    # Their places are not kept, so the whole row is NaN: native's exactly when every logit is NaN (a NaN token).
    chosen_nan = tl.sum((scores != scores).to(tl.int32), axis=1)
    nan_counts = tl.load(nan_counts_ptr + rows, mask=row_ok, other=0)
    grad_logits = tl.where((nan_counts > chosen_nan)[:, None], float("nan"), grad_logits)
    tl.store(grad_logits_ptr + out_offsets, grad_logits, mask=out_mask)


SCORE_FUNCS = ("sigmoid", "softmax", "sqrtsoftplus")
GROUP_SCORES = ("top2", "max")


def check_router_config(
    num_experts: int, top_k: int, n_group: int, topk_group: int, score_func: str = "sigmoid", group_score: str = "top2"
) -> None:
    """A ValueError naming the first setting the grouped top-k selection cannot honour (a router module's own check
    before a patch, and the kernel's on every call)."""
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"liger-dspine: score_func must be one of {SCORE_FUNCS}, got {score_func!r}")
    if group_score not in GROUP_SCORES:
        raise ValueError(f"liger-dspine: group_score must be one of {GROUP_SCORES}, got {group_score!r}")
    if n_group < 1 or num_experts % n_group:
        raise ValueError(f"liger-dspine: n_group={n_group} must divide the number of experts ({num_experts})")
    group_size = num_experts // n_group
    if group_size < 2 and group_score == "top2":
        raise ValueError(
            f"liger-dspine: each group needs at least 2 experts (group score = sum of its top 2), got {group_size}"
        )
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"liger-dspine: topk_group={topk_group} must be in [1, n_group={n_group}]")
    if not 1 <= top_k <= topk_group * group_size:
        native = masked_topk_reason(num_experts, top_k, n_group, topk_group)
        raise ValueError(
            f"liger-dspine: num_experts_per_tok={top_k} must be in "
            f"[1, topk_group * group size = {topk_group * group_size}] for the routing kernel"
            + ("; the router modules route such a layout with transformers' own routing" if native else "")
        )


def masked_topk_reason(num_experts: int, top_k: int, n_group: int, topk_group: int) -> str | None:
    """Why the kernel does not route a grouping transformers computes: ``top_k`` beyond the experts of the kept groups
    (and at most ``num_experts``), so that native routing takes experts of dropped groups, tied at their masked score,
    in ``torch.topk``'s order; None for any other grouping (``check_router_config`` judges those)."""
    if n_group < 1 or num_experts % n_group or not 1 <= topk_group <= n_group:
        return None
    kept = topk_group * (num_experts // n_group)
    if not kept < top_k <= num_experts:
        return None
    return (
        f"num_experts_per_tok={top_k} exceeds the {kept} experts of the topk_group={topk_group} kept group(s), so "
        "transformers fills the top-k with experts of dropped groups, tied at their masked score, in torch.topk's "
        "tie order, which the routing kernel does not reproduce"
    )


def _tokens_per_program(padded_row: int, tile: int) -> int:
    return max(1, min(_MAX_TOKENS_PER_PROGRAM, tile // padded_row))


def moe_router_forward(
    router_logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    score_func: str = "sigmoid",
    group_score: str = "top2",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Grouped top-k selection. ``router_logits [T, E]`` fp32, ``bias [E]`` or None.

    Returns ``topk_weights [T, K]`` fp32, ``topk_indices [T, K]`` int64, ``topk_scores [T, K]`` fp32 (the
    scores of the chosen experts, before renormalisation and scaling), ``nan_counts [T]`` int32 (the NaN logits of
    each row) and ``row_lse [T]`` fp32 (each row's log-sum-exp with "softmax", unset with "sigmoid"); the last
    three are what the backward needs.
    """
    if router_logits.dim() != 2 or router_logits.dtype != torch.float32:
        raise ValueError(
            f"liger-dspine: router_logits must be a 2-D fp32 tensor, "
            f"got {tuple(router_logits.shape)} {router_logits.dtype}"
        )
    num_experts = router_logits.shape[1]
    if bias is not None and bias.shape != (num_experts,):
        raise ValueError(
            f"liger-dspine: e_score_correction_bias must have shape ({num_experts},), got {tuple(bias.shape)}"
        )
    check_router_config(num_experts, top_k, n_group, topk_group, score_func, group_score)
    check_kernel_device(router_logits, "the MoE router kernel")
    if bias is not None:
        bias = bias.to(device=router_logits.device, dtype=torch.float32)
    return _moe_router_select(
        router_logits,
        bias,
        top_k,
        n_group,
        topk_group,
        bool(norm_topk_prob),
        float(routed_scaling_factor),
        score_func,
        group_score,
    )


@liger_custom_op("liger_dspine::moe_router_select", mutates_args=())
def _moe_router_select(
    router_logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    score_func: str,
    group_score: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward kernel's launch (inputs checked by :func:`moe_router_forward`)."""
    weights, indices, topk_scores, nan_counts, row_lse = _select_fake(router_logits, bias, top_k)
    num_tokens, num_experts = router_logits.shape
    if num_tokens == 0:
        return weights, indices, topk_scores, nan_counts, row_lse
    router_logits = router_logits.contiguous()
    group_size = num_experts // n_group
    block_g = triton.next_power_of_2(n_group)
    block_s = triton.next_power_of_2(group_size)
    block_t = _tokens_per_program(block_g * block_s, _FORWARD_TILE)
    _moe_router_forward_kernel[(triton.cdiv(num_tokens, block_t),)](
        router_logits,
        router_logits if bias is None else bias.contiguous(),  # not read without a bias
        weights,
        indices,
        topk_scores,
        nan_counts,
        row_lse,
        num_tokens,
        routed_scaling_factor,
        NUM_EXPERTS=num_experts,
        NUM_GROUPS=n_group,
        GROUP_SIZE=group_size,
        TOPK_GROUP=topk_group,
        TOP_K=top_k,
        NORMALIZE=norm_topk_prob,
        SOFTMAX=score_func == "softmax",
        SQRT_SOFTPLUS=score_func == "sqrtsoftplus",
        GROUP_MAX=group_score == "max",
        HAS_BIAS=bias is not None,
        BLOCK_T=block_t,
        BLOCK_G=block_g,
        BLOCK_S=block_s,
        BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=4,
    )
    return weights, indices, topk_scores, nan_counts, row_lse


@_moe_router_select.register_fake
def _select_fake(router_logits, bias, top_k, *_):
    num_tokens = router_logits.shape[0]
    weights = router_logits.new_empty(num_tokens, top_k)
    indices = torch.empty(num_tokens, top_k, dtype=torch.int64, device=router_logits.device)
    topk_scores = router_logits.new_empty(num_tokens, top_k)
    nan_counts = torch.empty(num_tokens, dtype=torch.int32, device=router_logits.device)
    row_lse = router_logits.new_empty(num_tokens)
    return weights, indices, topk_scores, nan_counts, row_lse


def moe_router_backward(
    grad_weights: torch.Tensor,
    topk_scores: torch.Tensor,
    topk_indices: torch.Tensor,
    nan_counts: torch.Tensor,
    num_experts: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    router_logits: torch.Tensor | None = None,
    row_lse: torch.Tensor | None = None,
    score_func: str = "sigmoid",
) -> torch.Tensor:
    """Gradient of the router logits ``[T, E]`` fp32 from the gradient of ``topk_weights [T, K]``; the softmax
    backward when ``router_logits`` and ``row_lse`` are given, else that of ``score_func`` ("sigmoid" or
    "sqrtsoftplus"), from the chosen scores alone."""
    if router_logits is None and score_func not in ("sigmoid", "sqrtsoftplus"):
        raise ValueError(f"liger-dspine: the {score_func!r} router backward needs router_logits and row_lse")
    check_kernel_device(topk_scores, "the MoE router backward kernel")
    return _moe_router_select_backward(
        grad_weights.to(torch.float32),
        topk_scores,
        topk_indices,
        nan_counts,
        num_experts,
        bool(norm_topk_prob),
        float(routed_scaling_factor),
        router_logits,
        row_lse,
        score_func,
    )


@liger_custom_op("liger_dspine::moe_router_select_backward", mutates_args=())
def _moe_router_select_backward(
    grad_weights: torch.Tensor,
    topk_scores: torch.Tensor,
    topk_indices: torch.Tensor,
    nan_counts: torch.Tensor,
    num_experts: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    router_logits: torch.Tensor | None,
    row_lse: torch.Tensor | None,
    score_func: str = "sigmoid",
) -> torch.Tensor:
    """The backward kernel's launch: a new [T, E] fp32 gradient, written densely."""
    num_tokens, top_k = topk_scores.shape
    grad_logits = topk_scores.new_empty(num_tokens, num_experts)
    if num_tokens == 0:
        return grad_logits
    softmax = router_logits is not None
    block_e = triton.next_power_of_2(num_experts)
    block_t = _tokens_per_program(block_e, _BACKWARD_TILE)
    _moe_router_backward_kernel[(triton.cdiv(num_tokens, block_t),)](
        grad_weights.contiguous(),
        topk_scores.contiguous(),
        topk_indices.contiguous(),
        nan_counts.contiguous(),
        router_logits.contiguous() if softmax else topk_scores,  # not read by the sigmoid backward
        row_lse if softmax else topk_scores,
        grad_logits,
        num_tokens,
        routed_scaling_factor,
        NUM_EXPERTS=num_experts,
        TOP_K=top_k,
        NORMALIZE=norm_topk_prob,
        SOFTMAX=softmax,
        SQRT_SOFTPLUS=not softmax and score_func == "sqrtsoftplus",
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=4,
    )
    return grad_logits


@_moe_router_select_backward.register_fake
def _(grad_weights, topk_scores, topk_indices, nan_counts, num_experts, *_):
    return topk_scores.new_empty(topk_scores.shape[0], num_experts)


class LigerMoeRouterFunction(torch.autograd.Function):
    """``(router_logits [T, E] fp32, bias [E] or None, ...) -> (topk_weights [T, K] fp32, topk_indices [T, K]
    int64)``; the trailing ``score_func`` / ``group_score`` default to DeepSeek-V3's "sigmoid" / "top2"."""

    kernel_ops = ("liger_dspine::moe_router_select", "liger_dspine::moe_router_select_backward")

    @staticmethod
    def forward(
        ctx,
        router_logits,
        bias,
        top_k,
        n_group,
        topk_group,
        norm_topk_prob,
        routed_scaling_factor,
        score_func="sigmoid",
        group_score="top2",
    ):
        weights, indices, topk_scores, nan_counts, row_lse = moe_router_forward(
            router_logits, bias, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor, score_func,
            group_score,
        )  # fmt: skip
        ctx.softmax = score_func == "softmax"
        ctx.score_func = score_func
        if ctx.softmax:
            ctx.save_for_backward(topk_scores, indices, nan_counts, router_logits, row_lse)
        else:
            ctx.save_for_backward(topk_scores, indices, nan_counts)
        ctx.num_experts = router_logits.shape[1]
        ctx.norm_topk_prob = norm_topk_prob
        ctx.routed_scaling_factor = routed_scaling_factor
        ctx.mark_non_differentiable(indices)
        return weights, indices

    @staticmethod
    @first_order_only
    def backward(ctx, grad_weights, _grad_indices):
        topk_scores, indices, nan_counts, *softmax_state = ctx.saved_tensors
        router_logits, row_lse = softmax_state if softmax_state else (None, None)
        grad_logits = None
        if ctx.needs_input_grad[0] and grad_weights is not None:
            grad_logits = moe_router_backward(
                grad_weights,
                topk_scores,
                indices,
                nan_counts,
                ctx.num_experts,
                ctx.norm_topk_prob,
                ctx.routed_scaling_factor,
                router_logits,
                row_lse,
                ctx.score_func,
            )
        return grad_logits, None, None, None, None, None, None, None, None


def liger_moe_router_topk(
    router_logits: torch.Tensor,
    e_score_correction_bias: torch.Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 1.0,
    *,
    score_func: str = "sigmoid",
    group_score: str = "top2",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped top-k routing of ``router_logits [T, E]`` (see the module docstring); DeepSeek-V3's by default.

    Returns ``(topk_weights [T, K], topk_indices [T, K] int64)``, each row ordered by choice, largest first.
    Differentiable with respect to ``router_logits`` through ``topk_weights``. The kernel works in fp32; logits of
    another dtype (the router GEMM under autocast, or a router computing in the model's dtype) are upcast, and the
    weights come back in that dtype.
    """
    dtype = router_logits.dtype
    weights, indices = LigerMoeRouterFunction.apply(
        router_logits.float(),
        e_score_correction_bias,
        top_k,
        n_group,
        topk_group,
        norm_topk_prob,
        routed_scaling_factor,
        score_func,
        group_score,
    )
    return weights.to(dtype), indices


@liger_custom_op("liger_dspine::router_logits_weight_grad", mutates_args=())
def _router_weight_grad(grad_logits: torch.Tensor, hidden_states: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``grad_logits [T, E] fp32 ^T @ hidden [T, H]`` in fp32 -> [E, H] in ``dtype``, the fp32 copy of hidden made
    here."""
    return grad_logits.t().mm(hidden_states.float()).to(dtype)


@_router_weight_grad.register_fake
def _(grad_logits, hidden_states, dtype):
    return hidden_states.new_empty(grad_logits.shape[1], hidden_states.shape[1], dtype=dtype)


class LigerRouterLogitsFunction(torch.autograd.Function):
    """``hidden [T, H] x weight [E, H] -> logits [T, E]`` in fp32, as ``F.linear(hidden.float(), weight.float())``.

    Same GEMMs as the native code, but it keeps ``hidden`` in its own dtype for the backward and casts it again
    there, instead of holding an fp32 copy ([T, H] x 4 bytes) between forward and backward. The weight gradient is
    one custom op of ``hidden``: under torch.compile the partitioner would otherwise keep the forward's fp32 copy.
    """

    kernel_ops = ("liger_dspine::router_logits_weight_grad",)

    @staticmethod
    def forward(ctx, hidden_states, weight):
        ctx.save_for_backward(hidden_states, weight)
        return hidden_states.float().mm(weight.float().t())

    @staticmethod
    @first_order_only
    def backward(ctx, grad_logits):
        hidden_states, weight = ctx.saved_tensors
        grad_hidden = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_hidden = grad_logits.mm(weight.float()).to(hidden_states.dtype)
        if ctx.needs_input_grad[1]:
            grad_weight = _router_weight_grad(grad_logits, hidden_states, weight.dtype)
        return grad_hidden, grad_weight


def liger_router_logits(hidden_states: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 router logits ``[T, E]`` of ``hidden_states [T, H]`` (any float dtype) and ``weight [E, H]``.

    Under autocast this is the native expression, whose GEMM autocast runs in low precision.
    """
    all_fp32 = hidden_states.dtype == torch.float32 and weight.dtype == torch.float32
    if all_fp32 or torch.is_autocast_enabled(hidden_states.device.type):
        return torch.nn.functional.linear(hidden_states.float(), weight.float())
    return LigerRouterLogitsFunction.apply(hidden_states, weight)
