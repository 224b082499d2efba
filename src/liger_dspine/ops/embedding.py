"""The input embedding with its weight gradient as one opaque op, for torch.compile.

Inductor decomposes ``embedding_dense_backward`` into a scatter-add over a zeroed fp32 copy of the whole table,
then a cast: at DeepSeek-V3's vocabulary (129280 x 7168) that is 3.5 GB of fp32 plus the 1.8 GB bf16 result at the
end of every compiled backward, on top of what eager code holds there. torch's own kernel (CUDA: indices sorted,
each segment summed in fp32, the table written once in its dtype) needs neither. :class:`LigerEmbeddingFunction`
runs the forward as ``F.embedding`` does and the weight gradient through the op ``liger_dspine::embedding_weight_grad``,
which calls that kernel; the numbers are torch's eager ones.
"""

import torch
import torch.nn.functional as F

from liger_dspine.ops.eager_dispatch import liger_custom_op
from liger_dspine.ops.first_order import first_order_only


@liger_custom_op("liger_dspine::embedding_weight_grad", mutates_args=())
def _embedding_weight_grad(
    grad: torch.Tensor, ids: torch.Tensor, num_weights: int, padding_idx: int, scale_grad_by_freq: bool
) -> torch.Tensor:
    """[num_weights, D] in grad's dtype: torch's eager ``embedding_dense_backward`` of grad [..., D] at ids [...]."""
    return torch.ops.aten.embedding_dense_backward(grad, ids, num_weights, padding_idx, scale_grad_by_freq)


@_embedding_weight_grad.register_fake
def _(grad, ids, num_weights, padding_idx, scale_grad_by_freq):
    return grad.new_empty(num_weights, grad.shape[-1])


class LigerEmbeddingFunction(torch.autograd.Function):
    """``(ids [...] int, weight [V, D], padding_idx | None, scale_grad_by_freq)`` -> ``weight[ids]`` [..., D]; the
    weight gradient by torch's eager kernel inside one custom op. The ids get no gradient."""

    kernel_ops = ("liger_dspine::embedding_weight_grad",)

    @staticmethod
    def forward(ctx, ids, weight, padding_idx, scale_grad_by_freq):
        ctx.save_for_backward(ids)
        ctx.num_weights = weight.shape[0]
        ctx.padding_idx = -1 if padding_idx is None else padding_idx
        ctx.scale_grad_by_freq = scale_grad_by_freq
        return F.embedding(ids, weight, padding_idx, None, 2.0, scale_grad_by_freq, False)

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = _embedding_weight_grad(
                grad.contiguous(), ids, ctx.num_weights, ctx.padding_idx, ctx.scale_grad_by_freq
            )
        return None, grad_weight, None, None


def liger_embedding(
    ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None = None, scale_grad_by_freq: bool = False
) -> torch.Tensor:
    """``F.embedding(ids, weight, padding_idx, scale_grad_by_freq=...)`` (no max_norm, dense gradient) through
    :class:`LigerEmbeddingFunction`."""
    if weight.dim() != 2:
        raise ValueError(f"liger-dspine: an embedding table must be [V, D], got {tuple(weight.shape)}")
    if ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"liger-dspine: embedding ids must be int32 or int64, got {ids.dtype}")
    if padding_idx is not None and padding_idx < 0:
        padding_idx += weight.shape[0]
    return LigerEmbeddingFunction.apply(ids, weight, padding_idx, bool(scale_grad_by_freq))
