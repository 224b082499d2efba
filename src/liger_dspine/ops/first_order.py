"""First-order gradients only, said plainly.

The backward of every autograd Function here computes from what its forward kept (Triton kernels, gradients formed
in the forward, statistics computed without a graph). In a backward with ``create_graph=True`` (a gradient penalty,
a Hessian-vector product, MAML) those would stand as constants: second-order terms through them would be dropped with
no error, or torch would fail deep inside with a message that names no cause. :func:`first_order_only` refuses such a
backward first, by name.
"""

import functools

import torch


def first_order_only(backward):
    """Wrap an autograd Function's ``backward`` (below ``@staticmethod``) to refuse a backward that builds a graph."""

    @functools.wraps(backward)
    def checked(ctx, *grads):
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
            owner = getattr(ctx, "first_order_name", None) or backward.__qualname__.split(".")[0]
            raise RuntimeError(
                f"liger-dspine: {owner} has first-order gradients only, and this backward builds a graph "
                "(create_graph=True: a gradient penalty, a Hessian-vector product) whose second-order terms through "
                "it would be missing. Take such gradients through the native modules: turn off the patch option "
                "that uses this kernel, or revert the patch."
            )
        return backward(ctx, *grads)

    checked.first_order_only = True
    return checked


class _FirstOrderBoundary(torch.autograd.Function):
    """Identity on the output of another package's kernel Function, refusing a graph-building backward for it."""

    kernel_ops = ()  # torch ops only

    @staticmethod
    def forward(ctx, output, what):
        ctx.first_order_name = what
        return output.view_as(output)

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        return grad, None


def first_order_boundary(output: torch.Tensor, what: str) -> torch.Tensor:
    """``output`` (of a kernel Function this package does not own, e.g. liger-kernel's) as is; a backward with
    ``create_graph=True`` through it is refused naming ``what``, before that kernel's backward runs."""
    return _FirstOrderBoundary.apply(output, what) if output.requires_grad else output
