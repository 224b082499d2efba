"""Triton kernels and chunk helpers shared by the fused frozen-head ops.

Per row of a chunk, with draft logits z = x W^T and teacher logits y = t W^T (both [C, V], contiguous):

- ``_frozen_head_stats_kernel``: pass 1 over V gives logsumexp(z), logsumexp(y), z[label] and the max of z over
  each ``TOPK_SUB`` columns; pass 2, from the row's end (whose blocks pass 1 read last, so L2 still holds many),
  gives l1 = sum |p - q| and S = sum p * sign(p - q). With a teacher it can then pick the top-k candidates
  (:func:`liger_dspine.ops.frozen_head_candidates.row_candidates`, whose first is the first argmax of z; without
  them pass 1 finds that argmax), and write dz in place of z in a third pass, in the direction opposite to the pass
  before it: the loss path's whole chunk in one kernel.
- ``_frozen_head_grad_kernel`` writes, in place of z,

      dz = a * (p - onehot(label)) + b * p * (s - S),   s = sign(p - q)

  for per-row scales a (CE) and b (L1): d l1 / d z_j = sum_v s_v p_v (delta_vj - p_j) = p_j (s_j - S).

The top-k of z comes from the sub-block maxima: the K largest elements of a row lie in the K sub-blocks with the
largest maxima (each of them is at least the K-th largest sub-block maximum), so the top-k looks only at those
K x ``TOPK_SUB`` columns (:mod:`liger_dspine.ops.frozen_head_candidates`; ``torch.topk`` for K above its limit).
"""

import torch
import triton
import triton.language as tl

from liger_dspine.ops.frozen_head_candidates import kernel_takes
from liger_dspine.ops.frozen_head_candidates import row_candidates
from liger_dspine.ops.frozen_head_candidates import top_candidates
from liger_dspine.ops.gemm_dtype import gemm_dtype

IGNORE_INDEX = -100
TOPK_SUB = 256  # columns per sub-block whose maximum the stats kernel records
_MAX_BLOCK_V = 4096
STATS_WARPS = 8  # the stats kernel's (also when it makes the candidates and dz)
STATS_MAX_REGISTERS = None  # a register cap a thread for the stats kernel; 128 (two programs an SM) measured slower
GRAD_WARPS = 4  # the gradient kernel's: 13% faster than 8 at hidden 4096 on an H100 (bench_frozen_head_kernels.py)


@triton.jit
def _grad_block(
    draft_row,
    teacher_row,
    start,
    cols,
    vocab_size,
    label,
    ce_scale,
    l1_scale,
    draft_lse,
    teacher_lse,
    sign_mass,
    HAS_TEACHER: tl.constexpr,
):
    """Overwrite one block of a row's draft logits with their gradient."""
    offsets = start + cols
    in_row = offsets < vocab_size
    z = tl.load(draft_row + offsets, mask=in_row, other=float("-inf")).to(tl.float32)
    p = tl.exp(z - draft_lse)
    grad = ce_scale * (p - tl.where(offsets == label, 1.0, 0.0))
    if HAS_TEACHER:
        y = tl.load(teacher_row + offsets, mask=in_row, other=float("-inf")).to(tl.float32)
        diff = p - tl.exp(y - teacher_lse)
        sign = tl.where(diff > 0, 1.0, tl.where(diff < 0, -1.0, 0.0))
        grad += l1_scale * p * (sign - sign_mass)
    tl.store(draft_row + offsets, grad.to(draft_row.dtype.element_ty), mask=in_row)


@triton.jit
def _frozen_head_stats_kernel(
    draft_logits_ptr,  # [C, V] float, contiguous (overwritten with dz under WRITE_GRAD)
    teacher_logits_ptr,  # [C, V] float, contiguous (unused without a teacher)
    labels_ptr,  # [C] int64
    ce_ptr,  # [C] fp32 out
    correct_ptr,  # [C] int8 out
    l1_ptr,  # [C] fp32 out
    draft_lse_ptr,  # [C] fp32 out
    teacher_lse_ptr,  # [C] fp32 out
    sign_mass_ptr,  # [C] fp32 out: S = sum_v p_v * sign(p_v - q_v)
    sub_max_ptr,  # [C, NS] fp32 out: max of z over each TOPK_SUB columns (unused without a teacher)
    ids_ptr,  # [C, K] int64 out: the candidates (TOP_K > 0)
    probs_ptr,  # [C, K] fp32 out: the teacher's probabilities there (TOP_K > 0)
    ce_scale_ptr,  # [C] fp32: a (WRITE_GRAD)
    l1_scale_ptr,  # [C] fp32: b (WRITE_GRAD with a teacher)
    vocab_size,
    num_sub,
    ignore_index,
    HAS_TEACHER: tl.constexpr,
    BLOCK_V: tl.constexpr,
    SUB: tl.constexpr,
    TOP_K: tl.constexpr,  # 0: no candidates here
    BLOCK_K: tl.constexpr,
    BLOCK_S: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    draft_row = draft_logits_ptr + row * vocab_size
    teacher_row = teacher_logits_ptr + row * vocab_size
    cols = tl.arange(0, BLOCK_V)
    subs = tl.arange(0, BLOCK_V // SUB)
    num_blocks = tl.cdiv(vocab_size, BLOCK_V)

    # Pass 1: normalisers (online max / sum-exp), the first argmax of the draft (from the candidates when they are
    # made here), its sub-block maxima.
    draft_max = float("-inf")
    draft_sum = 0.0
    best = 0
    teacher_max = float("-inf")
    teacher_sum = 0.0
    for start in range(0, vocab_size, BLOCK_V):
        offsets = start + cols
        in_row = offsets < vocab_size
        z = tl.load(draft_row + offsets, mask=in_row, other=float("-inf")).to(tl.float32)
        block_max = tl.max(z, axis=0)
        if TOP_K == 0:
            block_best = start + tl.argmax(z, axis=0, tie_break_left=True)
            best = tl.where(block_max > draft_max, block_best, best)  # strict: earlier blocks win ties
        new_max = tl.maximum(draft_max, block_max)
        draft_sum = draft_sum * tl.exp(draft_max - new_max) + tl.sum(tl.exp(z - new_max), axis=0)
        draft_max = new_max
        if HAS_TEACHER:
            sub_index = start // SUB + subs
            sub_max = tl.max(tl.reshape(z, (BLOCK_V // SUB, SUB)), axis=1)
            tl.store(sub_max_ptr + row * num_sub + sub_index, sub_max, mask=sub_index < num_sub)
            y = tl.load(teacher_row + offsets, mask=in_row, other=float("-inf")).to(tl.float32)
            new_teacher_max = tl.maximum(teacher_max, tl.max(y, axis=0))
            teacher_sum = teacher_sum * tl.exp(teacher_max - new_teacher_max) + tl.sum(
                tl.exp(y - new_teacher_max), axis=0
            )
            teacher_max = new_teacher_max
    draft_lse = draft_max + tl.log(draft_sum)

    label = tl.load(labels_ptr + row)
    labelled = label != ignore_index
    safe_label = tl.where(labelled, label, 0)
    label_logit = tl.load(draft_row + safe_label).to(tl.float32)
    tl.store(ce_ptr + row, tl.where(labelled, draft_lse - label_logit, 0.0))
    tl.store(draft_lse_ptr + row, draft_lse)

    teacher_lse = 0.0
    sign_mass = 0.0
    if HAS_TEACHER:
        teacher_lse = teacher_max + tl.log(teacher_sum)
        # Pass 2, last block first: the blocks pass 1 read last are the likeliest still in L2. The L1 distance and
        # the sign mass S the gradient needs.
        l1 = 0.0
        for step in range(num_blocks):
            offsets = (num_blocks - 1 - step) * BLOCK_V + cols
            in_row = offsets < vocab_size
            z = tl.load(draft_row + offsets, mask=in_row, other=float("-inf")).to(tl.float32)
            y = tl.load(teacher_row + offsets, mask=in_row, other=float("-inf")).to(tl.float32)
            p = tl.exp(z - draft_lse)
            diff = p - tl.exp(y - teacher_lse)
            sign = tl.where(diff > 0, 1.0, tl.where(diff < 0, -1.0, 0.0))
            l1 += tl.sum(tl.abs(diff), axis=0)
            sign_mass += tl.sum(p * sign, axis=0)
        tl.store(l1_ptr + row, l1)
        tl.store(teacher_lse_ptr + row, teacher_lse)
        tl.store(sign_mass_ptr + row, sign_mass)
        if TOP_K > 0:
            tl.debug_barrier()  # the row's sub-block maxima, stored by other threads of this program
            best = row_candidates(
                draft_row, teacher_row, sub_max_ptr + row * num_sub, teacher_lse, ids_ptr + row * TOP_K,
                probs_ptr + row * TOP_K, vocab_size, num_sub, TOP_K, BLOCK_K, BLOCK_S, SUB,
            )  # fmt: skip
    tl.store(correct_ptr + row, (labelled & (best == safe_label)).to(tl.int8))

    if WRITE_GRAD:
        # Pass 3, opposite to the pass before it (again for L2): dz in place of z, once every read of z is done.
        tl.debug_barrier()
        ce_scale = tl.where(labelled, tl.load(ce_scale_ptr + row), 0.0)
        l1_scale = tl.load(l1_scale_ptr + row) if HAS_TEACHER else 0.0
        for step in range(num_blocks):
            start = step * BLOCK_V if HAS_TEACHER else (num_blocks - 1 - step) * BLOCK_V
            _grad_block(
                draft_row, teacher_row, start, cols, vocab_size, label, ce_scale, l1_scale, draft_lse, teacher_lse,
                sign_mass, HAS_TEACHER,
            )  # fmt: skip


@triton.jit
def _frozen_head_grad_kernel(
    draft_logits_ptr,  # [C, V] float, contiguous: overwritten with dz
    teacher_logits_ptr,  # [C, V] float, contiguous (unused without a teacher)
    labels_ptr,  # [C] int64
    ce_scale_ptr,  # [C] fp32: a, the CE gradient of each row
    l1_scale_ptr,  # [C] fp32: b, the L1 gradient of each row (unused without a teacher)
    draft_lse_ptr,  # [C] fp32
    teacher_lse_ptr,  # [C] fp32
    sign_mass_ptr,  # [C] fp32
    vocab_size,
    ignore_index,
    HAS_TEACHER: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    label = tl.load(labels_ptr + row)
    ce_scale = tl.where(label != ignore_index, tl.load(ce_scale_ptr + row), 0.0)
    l1_scale = tl.load(l1_scale_ptr + row) if HAS_TEACHER else 0.0
    teacher_lse = tl.load(teacher_lse_ptr + row) if HAS_TEACHER else 0.0
    sign_mass = tl.load(sign_mass_ptr + row) if HAS_TEACHER else 0.0
    draft_lse = tl.load(draft_lse_ptr + row)
    for start in range(0, vocab_size, BLOCK_V):
        _grad_block(
            draft_logits_ptr + row * vocab_size, teacher_logits_ptr + row * vocab_size, start, tl.arange(0, BLOCK_V),
            vocab_size, label, ce_scale, l1_scale, draft_lse, teacher_lse, sign_mass, HAS_TEACHER,
        )  # fmt: skip


def _block_v(vocab_size: int) -> int:
    return max(TOPK_SUB, min(_MAX_BLOCK_V, triton.next_power_of_2(vocab_size)))


class ChunkStats:
    """What the stats kernel gives for one chunk of rows; tensors [C] unless noted. The candidates ([C, K]) are
    there when the kernel made them."""

    def __init__(self, rows: int, vocab_size: int, has_teacher: bool, top_k: int, device: torch.device):
        self.ce = torch.empty(rows, dtype=torch.float32, device=device)
        self.correct = torch.empty(rows, dtype=torch.int8, device=device)
        self.draft_lse = torch.empty_like(self.ce)
        self.l1 = self.teacher_lse = self.sign_mass = self.sub_max = None
        self.candidate_ids = self.candidate_probs = None
        if has_teacher:
            self.l1, self.teacher_lse, self.sign_mass = (torch.empty_like(self.ce) for _ in range(3))
            self.sub_max = torch.empty(rows, triton.cdiv(vocab_size, TOPK_SUB), dtype=torch.float32, device=device)
        if top_k:
            self.candidate_ids = torch.empty(rows, top_k, dtype=torch.int64, device=device)
            self.candidate_probs = torch.empty(rows, top_k, dtype=torch.float32, device=device)


def fuses_candidates(top_k: int, vocab_size: int) -> bool:
    """Whether the stats kernel makes a chunk's top-k candidates itself."""
    return kernel_takes(top_k, vocab_size, TOPK_SUB)


def stats_write_grad(has_teacher: bool, top_k: int, vocab_size: int) -> bool:
    """Whether :func:`chunk_stats` may take ``grad_scales`` and write dz: without a teacher, or with one whose
    candidates it makes (they read z before dz replaces it)."""
    return not has_teacher or fuses_candidates(top_k, vocab_size)


def chunk_stats(
    z: torch.Tensor,
    y: torch.Tensor | None,
    labels: torch.Tensor,
    block_v: int | None = None,
    warps: int = STATS_WARPS,
    top_k: int = 0,
    grad_scales: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    max_registers: int | None = STATS_MAX_REGISTERS,
) -> ChunkStats:
    """The stats kernel over one chunk; ``block_v`` (columns per step, default :func:`_block_v`), ``warps`` and
    ``max_registers`` (a cap a thread for the compiler; None: its own choice) are its launch settings.

    With a teacher and a ``top_k`` that :func:`fuses_candidates`, the same kernel makes the candidates. With
    ``grad_scales`` (a, b: [C] fp32, b None without a teacher) it then overwrites z with dz, as
    :func:`write_logit_grads` does; with a teacher that needs the candidates made here (they read z).
    """
    rows, vocab_size = z.shape
    has_teacher = y is not None
    fused_k = top_k if has_teacher and fuses_candidates(top_k, vocab_size) else 0
    if grad_scales is not None and not stats_write_grad(has_teacher, top_k, vocab_size):
        raise ValueError(f"liger-dspine: the stats kernel writes dz only after its own top-k, not for K = {top_k}")
    stats = ChunkStats(rows, vocab_size, has_teacher, fused_k, z.device)
    num_sub = stats.sub_max.shape[1] if has_teacher else 1
    ce_scale, l1_scale = grad_scales if grad_scales is not None else (None, None)
    unused = stats.ce
    _frozen_head_stats_kernel[(rows,)](
        z,
        y if has_teacher else z,
        labels,
        stats.ce,
        stats.correct,
        stats.l1 if has_teacher else unused,
        stats.draft_lse,
        stats.teacher_lse if has_teacher else unused,
        stats.sign_mass if has_teacher else unused,
        stats.sub_max if has_teacher else unused,
        stats.candidate_ids if fused_k else labels,
        stats.candidate_probs if fused_k else unused,
        unused if ce_scale is None else ce_scale,
        unused if l1_scale is None else l1_scale,
        vocab_size,
        num_sub,
        IGNORE_INDEX,
        HAS_TEACHER=has_teacher,
        BLOCK_V=block_v or _block_v(vocab_size),
        SUB=TOPK_SUB,
        TOP_K=fused_k,
        BLOCK_K=triton.next_power_of_2(max(fused_k, 1)),
        BLOCK_S=triton.next_power_of_2(num_sub),
        WRITE_GRAD=grad_scales is not None,
        num_warps=warps,
        **({} if max_registers is None else {"maxnreg": max_registers}),
    )
    return stats


def chunk_candidates(z: torch.Tensor, y: torch.Tensor, stats: ChunkStats, top_k: int):
    """Top-k draft ids [C, K] (descending logits) and the teacher's probabilities there [C, K] fp32."""
    if stats.candidate_ids is not None:
        return stats.candidate_ids, stats.candidate_probs
    if kernel_takes(top_k, z.shape[1], TOPK_SUB):
        return top_candidates(z, y, stats.sub_max, stats.teacher_lse, top_k, TOPK_SUB)
    return torch_candidates(z, y, stats, top_k)


def torch_candidates(z: torch.Tensor, y: torch.Tensor, stats: ChunkStats, top_k: int):
    """:func:`chunk_candidates` with torch's top-k (over the K largest sub-blocks where K x ``TOPK_SUB`` < V)."""
    vocab_size = z.shape[1]
    if top_k * TOPK_SUB >= vocab_size:
        ids = torch.topk(z, top_k, dim=-1).indices
    else:
        subs = torch.topk(stats.sub_max, top_k, dim=-1).indices  # [C, K]
        cols = (subs[:, :, None] * TOPK_SUB + torch.arange(TOPK_SUB, device=z.device)).flatten(1)  # [C, K*SUB]
        inside = cols < vocab_size
        values = z.gather(-1, cols.clamp(max=vocab_size - 1)).masked_fill(~inside, float("-inf"))
        ids = cols.gather(-1, torch.topk(values, top_k, dim=-1).indices)
    probs = torch.exp(y.gather(-1, ids).float() - stats.teacher_lse[:, None])
    return ids, probs


def write_logit_grads(
    z, y, labels, ce_scale, l1_scale, draft_lse, teacher_lse, sign_mass, block_v=None, warps=GRAD_WARPS
) -> None:
    """Overwrite z [C, V] with dz for per-row scales ``ce_scale`` and ``l1_scale`` ([C] fp32), from the chunk's
    statistics (the stats kernel's ``draft_lse``, ``teacher_lse`` and ``sign_mass``, [C] fp32); launch settings as
    :func:`chunk_stats`'s."""
    rows, vocab_size = z.shape
    has_teacher = y is not None
    _frozen_head_grad_kernel[(rows,)](
        z,
        y if has_teacher else z,
        labels,
        ce_scale,
        l1_scale if has_teacher else ce_scale,
        draft_lse,
        teacher_lse if has_teacher else draft_lse,
        sign_mass if has_teacher else draft_lse,
        vocab_size,
        IGNORE_INDEX,
        HAS_TEACHER=has_teacher,
        BLOCK_V=block_v or _block_v(vocab_size),
        num_warps=warps,
    )


class RowResults:
    """The per-row outputs of a fused frozen-head pass over R rows, filled chunk by chunk.

    ce [R] fp32, correct [R] bool; with a teacher also l1 [R] fp32, candidate_ids [R, K] int64 and
    candidate_probs [R, K] fp32; with ``keep_stats`` the normalisers and sign masses a recomputing backward needs.
    """

    def __init__(self, rows: int, top_k: int, has_teacher: bool, keep_stats: bool, device: torch.device):
        self.ce = torch.empty(rows, dtype=torch.float32, device=device)
        self.correct = torch.empty(rows, dtype=torch.bool, device=device)
        self.l1 = self.candidate_ids = self.candidate_probs = None
        self.draft_lse = self.teacher_lse = self.sign_mass = None
        if has_teacher:
            self.l1 = torch.empty_like(self.ce)
            self.candidate_ids = torch.empty(rows, top_k, dtype=torch.int64, device=device)
            self.candidate_probs = torch.empty(rows, top_k, dtype=torch.float32, device=device)
        if keep_stats:
            self.draft_lse = torch.empty_like(self.ce)
            if has_teacher:
                self.teacher_lse, self.sign_mass = torch.empty_like(self.ce), torch.empty_like(self.ce)
        self.top_k = top_k

    def store(self, start: int, end: int, z, y, stats: ChunkStats) -> None:
        """Write one chunk's results (unless the stats kernel made them, the top-k reads z: call this before z is
        overwritten with its gradient)."""
        self.ce[start:end], self.correct[start:end] = stats.ce, stats.correct
        if self.draft_lse is not None:
            self.draft_lse[start:end] = stats.draft_lse
        if y is None:
            return
        self.l1[start:end] = stats.l1
        if self.teacher_lse is not None:
            self.teacher_lse[start:end], self.sign_mass[start:end] = stats.teacher_lse, stats.sign_mass
        ids, probs = chunk_candidates(z, y, stats, self.top_k)
        self.candidate_ids[start:end], self.candidate_probs[start:end] = ids, probs

    def outputs(self) -> tuple:
        """(ce, correct) or (ce, correct, l1, candidate_ids, candidate_probs)."""
        if self.l1 is None:
            return self.ce, self.correct
        return self.ce, self.correct, self.l1, self.candidate_ids, self.candidate_probs


def chunk_logit_passes(draft_hidden, teacher_hidden, weight, chunk_rows):
    """For each chunk of rows: (start, end, z [C, V], y [C, V] or None) after one logits GEMM for draft and teacher
    rows together, in the weight's dtype.

    Every chunk's logits go into one buffer ([2C, V] with a teacher, [C, V] without), which the next chunk
    overwrites: a caller is done with a chunk's z and y when it asks for the next chunk. (A new output per chunk
    would hold two chunks' logits at once, since the next GEMM's output is allocated while the caller still holds
    the previous one.)
    """
    rows = draft_hidden.shape[0]
    factor = 1 if teacher_hidden is None else 2
    buffer = weight.new_empty(factor * min(chunk_rows, rows), weight.shape[0])
    for start in range(0, rows, chunk_rows):
        end = min(start + chunk_rows, rows)
        count = end - start
        inputs = draft_hidden[start:end]
        if teacher_hidden is not None:
            inputs = torch.cat([inputs, teacher_hidden[start:end]])
        logits = buffer[: factor * count]
        torch.mm(inputs.to(weight.dtype), weight.t(), out=logits)
        yield start, end, logits[:count], logits[count:] if teacher_hidden is not None else None


def chunk_passes(draft_hidden, teacher_hidden, labels, weight, chunk_rows, top_k=0, grad_scales=None):
    """For each chunk of rows: (start, end, z, y, stats) after the logits GEMM and the stats kernel, which makes the
    candidates where it can (:func:`chunk_stats`); with ``grad_scales`` (a [R], b [R] or None) it also overwrites z
    with dz."""
    for start, end, z, y in chunk_logit_passes(draft_hidden, teacher_hidden, weight, chunk_rows):
        rows = slice(start, end)
        scales = None
        if grad_scales is not None:
            ce_scale, l1_scale = grad_scales
            scales = (ce_scale[rows], None if l1_scale is None else l1_scale[rows])
        yield start, end, z, y, chunk_stats(z, y, labels[rows], top_k=top_k, grad_scales=scales)


def default_chunk_rows(rows: int, hidden_size: int, vocab_size: int) -> int:
    """Rows per chunk such that chunk x V is about R x H (liger-kernel's fused linear cross entropy rule)."""
    growth = triton.cdiv(vocab_size, hidden_size)
    return max(1, min(rows, triton.next_power_of_2(triton.cdiv(rows, growth))))


def check_inputs(draft_hidden, head_weight, labels, teacher_hidden, top_k, what: str) -> torch.dtype:
    """Validate shapes, the top-k, the head's grad and the labels (one host sync); returns the GEMM dtype."""
    if draft_hidden.dim() != 2 or head_weight.dim() != 2 or draft_hidden.shape[1] != head_weight.shape[1]:
        raise ValueError(
            f"liger-dspine: {what} expects draft rows [R, H] and a head [V, H], got {tuple(draft_hidden.shape)} "
            f"and {tuple(head_weight.shape)}"
        )
    rows, vocab_size = draft_hidden.shape[0], head_weight.shape[0]
    if labels.shape != (rows,):
        raise ValueError(f"liger-dspine: {what} expects labels [{rows}], got {tuple(labels.shape)}")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f"liger-dspine: {what} expects integer labels, got {labels.dtype}")
    if teacher_hidden is not None:
        if teacher_hidden.shape != draft_hidden.shape:
            raise ValueError(
                f"liger-dspine: {what}: teacher rows {tuple(teacher_hidden.shape)} differ from draft rows "
                f"{tuple(draft_hidden.shape)}"
            )
        if not 1 <= top_k <= vocab_size:
            raise ValueError(
                f"liger-dspine: {what} needs top_k >= 1 and at most the vocabulary ({vocab_size}), got {top_k}"
            )
    if torch.is_grad_enabled() and head_weight.requires_grad:
        raise ValueError(
            f"liger-dspine: {what} gives the head no gradient; freeze it (head_weight.requires_grad_(False)) "
            "or use the eager frozen_head_terms"
        )
    check_labels(labels, vocab_size, what)
    return gemm_dtype(draft_hidden, head_weight, what)


def check_labels(labels: torch.Tensor, vocab_size: int, what: str) -> None:
    """Every label is IGNORE_INDEX or in [0, V); otherwise a ValueError naming the first bad label."""
    bad = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= vocab_size))
    if labels.numel() and bool(bad.any()):
        first = int(labels[bad][0])
        raise ValueError(
            f"liger-dspine: {what}: label {first} is outside the vocabulary [0, {vocab_size}) "
            f"(and is not the ignore index {IGNORE_INDEX})"
        )
