"""A clear error, instead of wrong gradients, for a second backward through a graph whose kernels changed what they
saved during the first one.

Some backwards can run once: liger-kernel's fused losses form the input gradient in the forward and scale it in place
by the incoming gradient (:class:`ScaledOnce`: a second pass would scale it again), and the fused SwiGLU MLP writes
the gradients of gate and up over its saved activations (:class:`RunsOnce`). Such a node keeps its state as
``ctx.second_pass``, an object whose ``refusal()`` is the error message once another pass would be wrong (else None).

Each node refusing its own later pass is not enough: by the time the pass reaches it, nodes above it may have added
to a ``.grad``. :func:`graph_refusal` looks down the graph from the node a pass starts at (the model's loss or
logits, ``modules/backward_guard.py``) for such a node that this pass would run, so the pass is refused before any
gradient changes. It runs on later passes only: the first backward pays nothing.
"""

from collections import deque

import torch


class ScaledOnce:
    def __init__(self, what: str):
        self.what = what
        self.scaled_flags = []  # one device bool per pass: whether its upstream gradient was other than 1

    def note(self, grad) -> None:
        self.scaled_flags.append((grad != 1).any())

    def refusal(self) -> str | None:
        """The error of another pass once a pass scaled the kept gradient (reads the device flags on the host)."""
        if not any(bool(flag) for flag in self.scaled_flags):
            return None
        return (
            f"liger-dspine: this loss was already back-propagated once, and {self.what} rescaled its saved "
            "gradient in place then, so another pass through the same graph (backward(retain_graph=True) again, "
            "or autograd.grad(..., retain_graph=True) followed by backward()) would give wrong gradients. Run the "
            "forward again for each backward, or patch with vocab_chunked_lce=True, whose backward can run any "
            "number of times."
        )

    def refuse_if_scaled(self) -> None:
        message = self.refusal()
        if message:
            raise RuntimeError(message)


class RunsOnce:
    """The state of a backward that can run once (it overwrites what it saved): ``message`` once it ran."""

    def __init__(self, message: str):
        self.message = message
        self.spent = False

    def spend(self) -> None:
        self.spent = True

    def refusal(self) -> str | None:
        return self.message if self.spent else None

    def refuse(self) -> None:
        if self.spent:
            raise RuntimeError(self.message)


def graph_refusal(start) -> str | None:
    """The ``refusal()`` of the first node (breadth-first from the autograd node ``start``) that the backward now
    running would run and that cannot run again; None when there is none. Call it during a backward."""
    seen, queue = {start}, deque([start])
    while queue:
        node = queue.popleft()
        state = getattr(node, "second_pass", None)
        if state is not None and _runs_in_this_pass(node):
            message = state.refusal()
            if message:
                return message
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                queue.append(child)
    return None


def _runs_in_this_pass(node) -> bool:
    """False for a node ``autograd.grad(..., inputs=...)`` leaves out of this pass."""
    will_execute = getattr(torch._C, "_will_engine_execute_node", None)
    return will_execute is None or will_execute(node)
