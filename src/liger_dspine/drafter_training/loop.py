"""The ``train-drafter`` loop: capture on the fly, accumulation windows, AdamW, checkpoints, progress and metrics.

Each optimizer step captures the frozen target's taps for every micro-batch (timed apart from the rest), runs the
CE-only prepasses, then one window replay: one all-reduce of (sum CE, sum D), and under DDP one gradient
all-reduce, after the last micro-batch's backward (under FSDP2, a reduce-scatter after each micro-batch's backward).
The step's metrics are summed over the ranks (one small all-reduce); rank 0 logs them. ``parallel`` says how the
drafter and the target are spread over the ranks.
"""

import contextlib
import csv
import logging
import math
import os
import time

import torch
import torch.distributed as dist

from liger_dspine.drafter_training import data
from liger_dspine.drafter_training import offline_taps
from liger_dspine.drafter_training import parallel
from liger_dspine.drafter_training import reporting
from liger_dspine.drafter_training import setup
from liger_dspine.drafter_training import state
from liger_dspine.drafter_training import training_eval
from liger_dspine.models.dspine.accumulation import DSpineAccumulationWindow
from liger_dspine.models.dspine.capture import TargetCapture

logger = logging.getLogger(__name__)
METRICS = ("step", "loss", "accuracy", "candidate_coverage", "lr", "tokens_per_s", "step_s", "capture_s", "peak_gib")


def lr_lambda(warmup: int, total: int, schedule: str):
    """Linear warm-up over ``warmup`` steps, then cosine or linear decay to 0 at ``total`` (or constant)."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress

    return factor


def ddp_sync_context(ddp):
    """Gradients all-reduced only in the last micro-batch's backward of a window."""
    return lambda is_last: contextlib.nullcontext() if is_last or ddp is None else ddp.no_sync()


def drafter_step(window, capture, micro_batches, step, total_steps, sync_context=None, sync=lambda: None) -> dict:
    """Prepass every micro-batch (captured here), replay the window; returns the summed metrics and capture time."""
    capture_s = 0.0
    for micro in micro_batches:
        sync()
        start = time.perf_counter()
        batch = capture(**micro)
        sync()
        capture_s += time.perf_counter() - start
        window.prepass(batch, global_step=step, total_steps=total_steps)
    outputs = window.replay(sync_context=sync_context)
    sums = torch.tensor(
        [
            [float(o.loss_terms[0].detach()) for o in outputs],
            [float(o.loss_terms[1]) for o in outputs],
            [float(o.accuracy_denom) for o in outputs],
            [float(o.accuracy.detach()) * float(o.accuracy_denom) for o in outputs],
            [float(o.ratio_metrics["dspine/candidate_coverage"][0]) for o in outputs],
        ],
        dtype=torch.float64,
        device=outputs[0].loss_terms[0].device,  # NCCL reduces device tensors
    ).sum(dim=1)
    if dist.is_initialized():  # the global window's metrics, as one process on the whole batch logs them
        dist.all_reduce(sums)
    numerator, denominator, count, correct, covered = sums.tolist()
    return {
        "loss": numerator / max(denominator, 1.0),
        "accuracy": correct / max(count, 1.0),
        "candidate_coverage": covered / max(count, 1.0),
        "capture_s": capture_s,
    }


def _distributed_device():
    """(device, rank, world size); under torchrun the process group starts here (NCCL on CUDA, else gloo)."""
    if parallel.under_torchrun() and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local), rank, world
    return torch.device("cpu"), rank, world


def _rows(args, target, mask_token_id: int):
    """The packed rows; a tokenizer (``--tokenizer``, else the ``--target`` folder) is loaded only for chat lines."""
    vocab_size = target.get_output_embeddings().weight.shape[0]
    if args.dataset is None:
        return data.embedded_text_rows(args.seq_len, vocab_size, mask_token_id)
    tokenizer = data.TokenizerSource(args.tokenizer or args.target)
    documents = data.read_documents(args.dataset, tokenizer, vocab_size, mask_token_id)
    return data.pack_rows(documents, args.seq_len, tokenizer.pad_token_id)


def _progress(total: int, initial: int, enabled: bool):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=initial, unit="step", disable=not enabled, desc="train-drafter")


def train_drafter(args, stop_after: int | None = None) -> list[dict]:
    """Run (or resume) training as ``args`` (resolved by ``options.resolve``) says; returns this run's step metrics.

    ``stop_after``: stop once that many optimizer steps are done overall, as an interrupted run would.
    """
    device, rank, world = _distributed_device()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(args.dtype)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    target = setup.build_target(args, device, dtype)
    objective = setup.build_objective(args, target, device, dtype)
    draft = objective.draft_model
    capture = TargetCapture(target, draft.target_layer_ids)
    if capture.head_input.field is not None:
        logger.info("the target's head reads %s: the teacher is lm_head of it", capture.head_input)
    if getattr(args, "taps", None):
        stream = offline_taps.open_tap_stream(
            args.taps, args.seed, target, draft.target_layer_ids, args.seq_len, dtype, objective.mask_token_id
        )
        capture = offline_taps.already_captured
    else:
        stream = data.RowStream(_rows(args, target, objective.mask_token_id), args.seed)

    resume_from = state.latest_checkpoint(args.output_dir) if args.resume else None
    if args.resume and resume_from is None:
        logger.warning("liger-dspine: no checkpoint in %s: starting afresh", args.output_dir)
    if resume_from:
        state.load_weights(resume_from, draft)
    if getattr(args, "target_parallel", "replicate") == "tp" and capture is not offline_taps.already_captured:
        capture = parallel.tensor_parallel_capture(capture)
    wrapped, sync_context = parallel.wrap_drafter(objective, getattr(args, "drafter_parallel", "ddp"), device)
    window = DSpineAccumulationWindow(wrapped, args.accumulation_steps)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args.warmup_steps, args.steps, args.schedule))
    step, position = 0, 0
    if resume_from:
        step, position = state.load_training_state(resume_from, draft, optimizer, scheduler)
        logger.info("resumed from %s (step %d)", resume_from, step)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows_per_step = args.accumulation_steps * world * args.batch_size
    end = min(args.steps, stop_after) if stop_after is not None else args.steps
    progress = _progress(args.steps, step, rank == 0)
    reporter = reporting.open_reporter(getattr(args, "report_to", "none"), args.output_dir, args) if rank == 0 else None
    monitor = training_eval.acceptance_monitor(args, target, draft, objective.mask_token_id) if rank == 0 else None
    history = []
    while step < end:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sync()
        start = time.perf_counter()
        micro_batches = []
        for k in range(args.accumulation_steps):
            first = position + (k * world + rank) * args.batch_size
            micro_batches.append({key: v.to(device) for key, v in stream.batch(first, args.batch_size).items()})
        metrics = drafter_step(window, capture, micro_batches, step, args.steps, sync_context, sync)
        if args.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(draft.parameters(), args.max_grad_norm)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        step_s = time.perf_counter() - start
        step, position = step + 1, position + rows_per_step
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
        tokens = rows_per_step * args.seq_len
        metrics = {"step": step, **metrics, "lr": lr, "tokens_per_s": tokens / step_s, "step_s": step_s}
        metrics["peak_gib"] = peak
        if monitor is not None and monitor.due(step):
            metrics.update(monitor(step))
        history.append(metrics)
        _report(metrics, progress, rank, args.metrics_csv)
        if reporter is not None:
            reporter.log(metrics)
        if step == args.steps or (args.save_every and step % args.save_every == 0):
            folder = state.save_checkpoint(args.output_dir, draft, optimizer, scheduler, step, position)
            if rank == 0:
                logger.info("saved %s", folder)
    if progress is not None:
        progress.close()
    if reporter is not None:
        reporter.close()
    return history


def _report(metrics: dict, progress, rank: int, metrics_csv: str | None) -> None:
    if rank != 0:
        return
    line = (
        f"loss {metrics['loss']:.4f} acc {metrics['accuracy']:.3f} cover {metrics['candidate_coverage']:.3f} "
        f"{metrics['tokens_per_s']:.0f} tok/s"
    )
    if progress is not None:
        progress.set_postfix_str(line, refresh=False)
        progress.update(1)
    else:
        logger.info("step %d: %s", metrics["step"], line)
    if metrics_csv:
        new = not os.path.exists(metrics_csv)
        with open(metrics_csv, "a", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=METRICS)
            if new:
                writer.writeheader()
            writer.writerow({key: metrics[key] for key in METRICS})
