"""A clear error, instead of wrong gradients, for a second backward through liger-kernel's cross-entropy kernel.

liger-kernel's cross-entropy kernel computes the input gradient in the forward and keeps it; its backward multiplies
it *in place* by the incoming gradient when that is not exactly 1 (the fused linear cross entropy's eager Function,
``ops/liger_kernel_ops.py``, keeps the same ``ScaledOnce`` state, ``ops/second_pass.py``, itself). A second pass
through the same graph (``backward(retain_graph=True)`` twice, or ``torch.autograd.grad(..., retain_graph=True)``
then ``backward()``) would scale it again and give wrong gradients with no error. Two identity nodes around such a
loss turn that into an error: the inner one, on the kernel's loss, notes when the kernel's backward scales its saved
gradient; the outer one, on the loss handed to the caller, runs first in every later pass and refuses it before
any gradient reaches the kernel or a ``.grad``. Passes with an upstream gradient of exactly 1 change nothing in the
kernel and stay allowed. The note is a device flag, read on the host only when a later pass starts, so the first
backward waits for nothing.

:func:`refuse_later_passes` guards a model's outputs (the causal-LM forwards' loss and logits): a later pass is
refused at the output's own node, before any gradient changes, when it would run a node below that cannot run again
(``ops/second_pass.py``: the fused losses' rescaled gradients, the fused SwiGLU MLP's overwritten activations).
"""

import torch

from liger_dspine.ops.first_order import first_order_only
from liger_dspine.ops.second_pass import ScaledOnce
from liger_dspine.ops.second_pass import graph_refusal


class _GuardFunction(torch.autograd.Function):
    """Identity on a loss, keeping the guard's shared state (``ctx.second_pass``, which ``graph_refusal`` reads) for
    its backward. Eager only: under torch.compile the causal-LM forwards take a fused loss whose backward needs no
    guard."""

    kernel_ops = ()  # torch ops only

    @staticmethod
    def forward(ctx, loss, state):
        ctx.second_pass = state
        return loss.clone()


class _NoteScaledFunction(_GuardFunction):
    """On the kernel's loss: its backward notes a gradient other than 1 (the kernel then scales)."""

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        ctx.second_pass.note(grad)
        return grad, None


class _RefuseAfterScaledFunction(_GuardFunction):
    """On the caller's loss: its backward refuses a pass after the kernel scaled its saved gradient."""

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        ctx.second_pass.refuse_if_scaled()
        return grad, None


class SecondPassGuard:
    """``inner`` wraps the kernel's loss, ``outer`` the loss returned to the caller (computed from the inner one)."""

    def __init__(self, what: str):
        self._state = ScaledOnce(what)

    def inner(self, loss: torch.Tensor) -> torch.Tensor:
        return _NoteScaledFunction.apply(loss, self._state) if loss.requires_grad else loss

    def outer(self, loss: torch.Tensor) -> torch.Tensor:
        return _RefuseAfterScaledFunction.apply(loss, self._state) if loss.requires_grad else loss


class _LaterPasses:
    """A node pre-hook counting the passes through its node; from the second on, it refuses one that would run a
    node below that cannot run again. It holds no reference to the node (that would keep the graph alive)."""

    def __init__(self):
        self.passes = 0

    def __call__(self, grad_outputs):
        self.passes += 1
        if self.passes > 1:
            message = graph_refusal(torch._C._current_autograd_node())
            if message:
                raise RuntimeError(message)


def refuse_later_passes(output: torch.Tensor | None) -> torch.Tensor | None:
    """``output`` (a model's loss or logits) as is; a later backward pass through its graph that would run a node
    that cannot run again is refused when it reaches ``output``'s node, before any gradient changes."""
    # compiled: the losses' Op Functions and the MLP's copies can run again (and grad_fn would break the graph)
    if torch.compiler.is_compiling() or output is None or output.grad_fn is None:
        return output
    output.grad_fn.register_prehook(_LaterPasses())
    return output
