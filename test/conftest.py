"""Test set-up: without CUDA every Triton kernel runs through Triton's interpreter.

The interpreter must be switched on before any kernel module is imported, so it happens here, first.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("LIGER_DSPINE_INTERPRET", "1")

import pytest  # noqa: E402

import liger_dspine  # noqa: E402,F401  (enables the interpreter from the environment)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture(scope="module")
def one_cpu_thread():
    """One torch thread for a module of tiny CPU shapes: more threads only add overhead (about 15 ms a GEMM on a
    2-core runner)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)
