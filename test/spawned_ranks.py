"""Joining spawned gloo ranks without waiting forever on a process group's teardown."""

import time

import pytest


def join_ranks(context, finished, limit_s: float, teardown_s: float, what: str) -> None:
    """Waits for the processes of ``context`` (``torch.multiprocessing.start_processes(..., join=False)``).

    ``finished()`` says whether every rank has passed its last collective (the results are whole). A rank still
    alive ``teardown_s`` after that is stopped: gloo's process-group teardown can wait on a peer that has already
    exited. Anything else that outlasts ``limit_s`` is stopped and fails the test. A rank's exception is raised by
    ``context.join`` as ``ProcessException``.
    """
    deadline, done_at = time.monotonic() + limit_s, None
    while not context.join(timeout=2):
        if done_at is None and finished():
            done_at = time.monotonic()
        if (done_at is not None and time.monotonic() - done_at > teardown_s) or time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            if done_at is None:
                pytest.fail(f"{what} did not finish within {limit_s:.0f} s")
            return


def _gloo_rank(rank, world_size, folder, function, args):
    import faulthandler
    import os
    import sys
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    log = open(os.path.join(folder, f"rank{rank}.log"), "w")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    faulthandler.enable(file=log, all_threads=True)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("LIGER_DSPINE_INTERPRET", "1")
    # what torchrun sets, and what transformers' distributed loading reads
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ.update(LOCAL_WORLD_SIZE=str(world_size))
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(folder, 'store')}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=120),
    )
    try:
        torch.set_num_threads(1)
        result = function(rank, world_size, *args)
        dist.barrier()
        if rank == 0:
            torch.save(result, os.path.join(folder, "results.tmp"))
            os.replace(os.path.join(folder, "results.tmp"), os.path.join(folder, "results.pt"))
    finally:
        dist.destroy_process_group()


def run_on_gloo_ranks(folder, world_size: int, function, *args, limit_s: float = 600.0):
    """Runs ``function(rank, world_size, *args)`` (a module-level function) on ``world_size`` spawned gloo ranks and
    returns rank 0's result. A rank's exception fails the call with its traceback's last line and its log's path."""
    import os

    import torch
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    folder = str(folder)
    results = os.path.join(folder, "results.pt")
    context = mp.start_processes(
        _gloo_rank, args=(world_size, folder, function, args), nprocs=world_size, join=False, start_method="spawn"
    )
    try:
        join_ranks(
            context, lambda: os.path.exists(results), limit_s, 30.0, f"{function.__name__} on {world_size} ranks"
        )
    except ProcessException as error:
        if not os.path.exists(results):
            raise RuntimeError(
                f"{function.__name__}: {str(error).strip().splitlines()[-1]} (logs in {folder})"
            ) from None
    return torch.load(results)
