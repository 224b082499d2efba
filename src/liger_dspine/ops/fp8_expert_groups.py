"""The grouped experts' GEMMs on FP8 (e4m3) operands with dynamic rowwise scales: :class:`FP8ExpertGroups` has
the two methods of :class:`~liger_dspine.ops.grouped_experts.ExpertGroups` and quantises both operands of each
product along its contraction dimension (:mod:`liger_dspine.ops.fp8_quantize`) before calling the FP8 grouped GEMMs
of :mod:`liger_dspine.ops.fp8_grouped_mm`::

    rows_mm(rows [S, K'], weights [E, K', N])   rows per row over K', weights[e] per column n over K'
    weight_grad(left [M, S], right [S, N])      both per feature over each group's rows (zero-padded to 16)

On CUDA (compute capability 9.0 or 10.0, bf16) each product is one ``torch._scaled_grouped_mm``; elsewhere the FP8
ops' reference runs (fp8 values as fp32, fp32 matmul per group, times the two scales, rounded to the GEMM dtype).

The expert weights stay in their own dtype and are quantised again at every call: rowwise in forward (gate_up_proj
per output row over H, down_proj per output row over I), per column in backward (gate_up_proj over 2I for the input
gradient, down_proj over H for grad_out @ down_proj). The forward's rowwise pass reads a weight once (2 bytes an
element in bf16), writes it once (1 byte) and also finds the column amaxes the backward needs ([E, H] and [E, I]
int32, kept by the forward); the backward's column quantiser then reads it once and writes it once. So a step costs
6 bytes of memory traffic per expert weight element (3 forward, 3 backward; 8 with a separate amax pass), plus 4
bytes per fp32 scale, and holds one fp8 copy of a weight (1 byte an element) while its GEMM runs. For DeepSeek-V3's
routed experts (E = 256, H = 7168, I = 2048: 3 * H * I = 44,040,192 elements an expert, 11.27e9 a layer) that is
264 MB an expert and 67.6 GB a layer per step (about 20 ms of HBM time at 3.35 TB/s), and a transient fp8
gate_up_proj of 7.5 GB a layer; divide by the expert-parallel degree for one rank's share.
"""

import torch

from liger_dspine.ops.fp8_grouped_mm import GROUPED_FP8_CAPABILITIES
from liger_dspine.ops.fp8_grouped_mm import _grouped_rows_mm
from liger_dspine.ops.fp8_grouped_mm import _grouped_weight_grad
from liger_dspine.ops.fp8_linear import check_fp8_device
from liger_dspine.ops.fp8_linear import check_multiple_of_16
from liger_dspine.ops.fp8_quantize import quantize_columns
from liger_dspine.ops.fp8_quantize import quantize_group_columns
from liger_dspine.ops.fp8_quantize import quantize_rowwise
from liger_dspine.ops.fp8_quantize import quantize_rowwise_keeping_amax

FP8_EXPERTS_OPS = (
    "liger_dspine::fp8_quantize_rows",
    "liger_dspine::fp8_quantize_columns",
    "liger_dspine::fp8_quantize_group_columns",
    "liger_dspine::fp8_grouped_mm",
    "liger_dspine::fp8_grouped_mm_weight_grad",
)
_CPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what the quantisers take


def check_fp8_experts(device: torch.device, dtype: torch.dtype, hidden: int, intermediate: int) -> None:
    """Refuse what the FP8 grouped GEMMs cannot run: H or I not multiples of 16; on CUDA a GPU other than compute
    capability 9.0 / 10.0 or a GEMM dtype other than bf16; elsewhere a dtype other than fp16 / bf16 / fp32."""
    check_multiple_of_16("FP8 grouped experts", H=hidden, I=intermediate)
    check_fp8_device(device, "FP8 grouped experts", GROUPED_FP8_CAPABILITIES)
    allowed = (torch.bfloat16,) if device.type == "cuda" else _CPU_DTYPES
    if dtype not in allowed:
        names = " / ".join(str(d).removeprefix("torch.") for d in allowed)
        raise ValueError(f"liger-dspine: FP8 grouped experts compute in {names} on {device.type}, got {dtype}")


def _per_column(weights: torch.Tensor, amax: torch.Tensor | None = None, keep_amax: bool = False):
    """weights [E, K', N] -> (q [E, N, K'] fp8, scale [E, N], amax): each column of weights[e] scaled over K'. A
    transposed view of a row-major [E, N, K'] is quantised rowwise in place of it, which with ``keep_amax`` also
    finds each row's largest |weights[e, k', :]| ([E, K'] int32 fp32 bits; None for other layouts and without
    ``keep_amax``): the ``amax`` that the column quantiser of a row-major [E, K', N] (K' a multiple of 16: no
    padding) takes for the same values, in the backward, instead of a pass of its own."""
    if quantised_rowwise(weights):
        return quantize_rowwise_keeping_amax(weights.transpose(1, 2), keep_amax)
    q, scale = quantize_columns(weights, amax)  # finds its own amax when none is given
    return q, scale, None


def quantised_rowwise(weights: torch.Tensor) -> bool:
    """Whether :func:`_per_column` quantises ``weights`` [E, K', N] as the rows of its transpose (a row-major
    [E, N, K']), which also gives the amax the backward takes."""
    return weights.transpose(1, 2).is_contiguous()


class FP8ExpertGroups:
    """The S expert-sorted rows split in E groups ending at ``offsets`` (int32, [E]); products on e4m3 operands."""

    def __init__(self, offsets: torch.Tensor):
        self.offsets = offsets

    def rows_mm(self, rows: torch.Tensor, weights: torch.Tensor, weight_amax: torch.Tensor | None = None):
        """[S, K'] rows, [E, K', N] weights -> [S, N] in rows' dtype: each group's rows times its expert's matrix.
        ``weight_amax``: what :meth:`rows_mm_keeping_amax` kept for the transpose of these weights."""
        return self._rows_mm(rows, weights, weight_amax, False)[0]

    def rows_mm_keeping_amax(self, rows: torch.Tensor, weights: torch.Tensor):
        """(:meth:`rows_mm`, the largest |weights[e, k', :]| [E, K'] int32) for weights that are the transpose of a
        row-major [E, N, K']: the amax of the backward's product with that row-major tensor (None for weights of
        another layout, whose backward then finds it itself)."""
        return self._rows_mm(rows, weights, None, True)

    def _rows_mm(self, rows, weights, weight_amax, keep_amax):
        if rows.shape[0] == 0 and not keep_amax:
            return rows.new_zeros(0, weights.shape[2]), None
        q_weights, scale_weights, amax = _per_column(weights, weight_amax, keep_amax)
        if rows.shape[0] == 0:
            return rows.new_zeros(0, weights.shape[2]), amax
        q_rows, scale_rows = quantize_rowwise(rows)
        return _grouped_rows_mm(q_rows, scale_rows, q_weights, scale_weights, self.offsets, rows.dtype), amax

    def weight_grad(self, left: torch.Tensor, right: torch.Tensor, right_rows: torch.Tensor | None = None):
        """[M, S] and [S, N] (or ``right[right_rows]``, a gather freed once quantised) -> [E, M, N] in left's dtype:
        per group, the product over its rows; zeros for an expert with no rows."""
        if left.shape[1] == 0:
            return left.new_zeros(self.offsets.shape[0], left.shape[0], right.shape[1])
        gathered = right if right_rows is None else right[right_rows]
        q_right, scale_right, _ = quantize_group_columns(gathered, self.offsets)  # [N, Sp], [E, N]
        del gathered
        q_left, scale_left, padded_offsets = quantize_group_columns(left.t(), self.offsets)  # [M, Sp], [E, M]
        return _grouped_weight_grad(q_left, scale_left, q_right, scale_right, padded_offsets, left.dtype)
