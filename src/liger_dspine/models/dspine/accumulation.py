"""Gradient accumulation for the DSpine objective: CE-only prepasses, one all-reduce, replays.

The alignment term is scaled by the *global* weighted mean backbone CE of the whole accumulation window, which is
known only once every micro-batch of every rank has been seen. Instead of keeping activations (or all-reducing per
micro-batch), each micro-batch first runs a graph-free CE-only prepass that records its (sum CE, D) and the RNG
state it started from. When the window is complete, one all-reduce of the 2-vector (sum CE, sum D) gives both the
alignment scale and the global denominator; every micro-batch is then replayed with autograd, from its saved RNG
state (same anchors, same teacher-forcing draw), and back-propagated with ``numerator / D_global``. The RNG state
after the window is the one the prepasses left.

A micro-batch without anchors (prompt-only or padding rows) draws nothing and adds 0 to the window's sums and
exactly 0 to every gradient: the window's gradient is the one it has without that micro-batch. A window without any
anchor back-propagates a zero loss (every gradient 0, no NaN), as this package's causal-LM losses do for a batch
whose labels are all ignored where transformers' loss divides 0 by 0; the optimizer step that follows still applies
its momentum and weight decay, as a ``transformers.Trainer`` step would.

Example::

    objective = DSpineObjective(draft, target.lm_head, target.model.embed_tokens).train()
    window = DSpineAccumulationWindow(objective, accumulation_steps=2)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=6e-4)
    for step, micro_batches in enumerate(windows_of(loader, 2)):
        for batch in micro_batches:  # dicts: input_ids, hidden_states, loss_mask, target_last_hidden_states
            window.prepass(batch, global_step=step, total_steps=num_steps)
        outputs = window.replay()  # one all-reduce, then forward + backward per micro-batch
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

With DDP, wrap the objective (``ddp = DDP(objective, broadcast_buffers=False)``; its frozen head and embedding
need no gradient), hand ``ddp`` to the window and pass
``sync_context=lambda last: contextlib.nullcontext() if last else ddp.no_sync()`` to :meth:`replay`. DDP averages
gradients over ranks, which ``average_gradients_across_ranks=True`` (the default) compensates for.
"""

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from liger_dspine.models.dspine.blocks import max_valid_anchor_count
from liger_dspine.models.dspine.objective import BACKBONE_CE
from liger_dspine.models.dspine.objective import DSpineObjectiveOutput
from liger_dspine.models.dspine.objective import mean_or_zero


@dataclass
class _PendingMicroBatch:
    batch: dict
    devices: dict
    cpu_rng_state: torch.Tensor
    cuda_device: int | None
    cuda_rng_state: torch.Tensor | None
    global_step: int
    total_steps: int | None


class DSpineAccumulationWindow:
    """Drives prepass / replay over windows of ``accumulation_steps`` micro-batches.

    Args:
        objective: a :class:`DSpineObjective` (or a callable with its signature).
        accumulation_steps: micro-batches per optimizer step.
        group: process group of the single all-reduce (default group when None).
        average_gradients_across_ranks: multiply the replayed losses by the world size, for data-parallel
            wrappers that average gradients (DDP, FSDP). Set False when gradients are summed.
        offload_batch: keep each micro-batch on the host between its prepass and its replay.
    """

    def __init__(
        self,
        objective: Callable[..., DSpineObjectiveOutput],
        accumulation_steps: int,
        group=None,
        average_gradients_across_ranks: bool = True,
        offload_batch: bool = True,
    ):
        if accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be >= 1, got {accumulation_steps}")
        self.objective = objective
        self.accumulation_steps = accumulation_steps
        self.group = group
        self.average_gradients_across_ranks = average_gradients_across_ranks
        self.offload_batch = offload_batch
        self._pending: list[_PendingMicroBatch] = []
        self._window_totals: torch.Tensor | None = None

    @property
    def is_complete(self) -> bool:
        return len(self._pending) == self.accumulation_steps

    def prepass(self, batch: dict, global_step: int = 0, total_steps: int | None = None) -> DSpineObjectiveOutput:
        """Run the CE-only prepass of one micro-batch (no graph) and keep what its replay needs.

        Args:
            batch: keyword arguments of the objective (``input_ids``, ``hidden_states``, ``loss_mask``,
                ``target_last_hidden_states``, optionally ``max_valid_anchors``).
        """
        if self.is_complete:
            raise RuntimeError("DSpine accumulation window is full: call replay() before the next prepass")
        stored, devices = _store(batch, self.offload_batch)
        if "max_valid_anchors" not in stored and self.offload_batch and "loss_mask" in stored:
            # From the host copy: the objective then needs no device sync, and prepass and replay agree on N.
            stored["max_valid_anchors"] = max_valid_anchor_count(stored["loss_mask"], stored.get("document_ids"))
            batch = {**batch, "max_valid_anchors": stored["max_valid_anchors"]}
        cuda_device = _cuda_device(batch)
        cpu_state = torch.get_rng_state()
        cuda_state = torch.cuda.get_rng_state(cuda_device) if cuda_device is not None else None
        with torch.no_grad():
            output = self.objective(**batch, global_step=global_step, total_steps=total_steps, ce_only=True)
        ce, denominator = output.ratio_metrics[BACKBONE_CE]
        totals = torch.stack([ce.detach().float(), denominator.detach().float()])
        self._window_totals = totals if self._window_totals is None else self._window_totals + totals
        self._pending.append(
            _PendingMicroBatch(stored, devices, cpu_state, cuda_device, cuda_state, global_step, total_steps)
        )
        return output

    def replay(self, backward: bool = True, sync_context=None) -> list[DSpineObjectiveOutput]:
        """Reduce the window once, then run the full objective of every micro-batch (and back-propagate).

        Each micro-batch backpropagates ``numerator / D_global`` (times the world size when gradients are
        averaged across ranks), so the accumulated gradient is that of sum(numerators) / sum(D) over the
        global window.

        Args:
            backward: call ``backward()`` on each replayed loss, in order.
            sync_context: ``is_last -> context manager`` around each replayed forward and backward (e.g. DDP
                ``no_sync``, which must cover the forward too).

        Returns:
            The full-objective outputs, in prepass order.
        """
        if not self.is_complete:
            raise RuntimeError(
                f"incomplete gradient accumulation window: {len(self._pending)} of {self.accumulation_steps} prepasses"
            )
        totals = self._window_totals.clone()
        world_size = 1
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=self.group)
            world_size = dist.get_world_size(self.group)
        alignment_ce = mean_or_zero(totals[0], totals[1]).detach()
        # max(D_global, 1), as the objective's own loss: D is at least 1 for any anchor (its first proposal weighs 1)
        scale = (world_size if self.average_gradients_across_ranks else 1) / totals[1].clamp_min(1.0)
        pending, self._pending, self._window_totals = self._pending, [], None
        outputs = []
        for index, micro in enumerate(pending):
            batch = _restore(micro.batch, micro.devices)
            devices = [micro.cuda_device] if micro.cuda_device is not None else []
            is_last = index == len(pending) - 1
            # DDP decides in its forward whether the backward reduces: the context spans both
            context = sync_context(is_last) if sync_context is not None and backward else contextlib.nullcontext()
            with context:
                with torch.random.fork_rng(devices=devices):
                    torch.set_rng_state(micro.cpu_rng_state)
                    if micro.cuda_device is not None:
                        torch.cuda.set_rng_state(micro.cuda_rng_state, micro.cuda_device)
                    output = self.objective(
                        **batch, global_step=micro.global_step, total_steps=micro.total_steps, alignment_ce=alignment_ce
                    )
                if backward:
                    (output.loss_terms[0] * scale.to(output.loss_terms[0].device)).backward()
            outputs.append(output)
        return outputs

    def reset(self) -> None:
        """Drop an unfinished window."""
        self._pending, self._window_totals = [], None


def _cuda_device(batch: dict) -> int | None:
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.device.type == "cuda":
            return value.device.index if value.device.index is not None else torch.cuda.current_device()
    return None


def _store(batch: dict, offload: bool) -> tuple[dict, dict]:
    stored, devices = {}, {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            devices[key] = value.device
            value = value.detach().to("cpu", copy=True) if offload else value.detach()
        stored[key] = value
    return stored, devices


def _restore(stored: dict, devices: dict) -> dict:
    return {key: value.to(devices[key]) if key in devices else value for key, value in stored.items()}
