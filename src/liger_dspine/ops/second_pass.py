"""A clear error, instead of wrong gradients, for a second backward through a loss whose kept gradient was scaled in
place by the first one.

liger-kernel's fused losses form the input gradient in the forward and keep it; the backward multiplies it in place by
the incoming gradient. A later pass through the same graph would scale it again. :class:`ScaledOnce` notes, per pass,
whether the incoming gradient was other than 1 (a device flag: the first backward waits for nothing) and refuses a
later pass after one that scaled (reading the flags on the host then).
"""


class ScaledOnce:
    def __init__(self, what: str):
        self.what = what
        self.scaled_flags = []  # one device bool per pass: whether its upstream gradient was other than 1

    def note(self, grad) -> None:
        self.scaled_flags.append((grad != 1).any())

    def refuse_if_scaled(self) -> None:
        if any(bool(flag) for flag in self.scaled_flags):
            raise RuntimeError(
                f"liger-dspine: this loss was already back-propagated once, and {self.what} rescaled its saved "
                "gradient in place then, so another pass through the same graph (backward(retain_graph=True) again, "
                "or autograd.grad(..., retain_graph=True) followed by backward()) would give wrong gradients. Run the "
                "forward again for each backward, or patch with vocab_chunked_lce=True, whose backward can run any "
                "number of times."
            )
