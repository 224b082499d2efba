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
