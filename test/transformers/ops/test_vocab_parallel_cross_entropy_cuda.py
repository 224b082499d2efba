"""The vocabulary-parallel fused loss on CUDA, in a one-rank NCCL group, against an fp64 eager reference.

With one rank its shard is the whole head, so the loss and both gradients must be the plain cross entropy's. The
several-rank cases run on gloo in test/transformers/distributed/test_vocab_parallel_cross_entropy.py.
"""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from test_linear_cross_entropy import make_inputs
from test_linear_cross_entropy import reference
from test_linear_cross_entropy import relative_error

from liger_dspine.ops.linear_cross_entropy import IGNORE_INDEX
from liger_dspine.ops.vocab_parallel_cross_entropy import liger_vocab_parallel_linear_cross_entropy


@pytest.fixture(scope="module")
def one_rank_nccl_group():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if dist.is_initialized():
        yield dist.new_group([0])
        return
    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1)
    yield None
    dist.destroy_process_group()


@pytest.mark.cuda
@pytest.mark.parametrize(
    "tokens,hidden_size,vocab,dtype,tolerance",
    [(512, 1024, 32000, torch.float32, 1e-5), (2048, 7168, 129280, torch.bfloat16, 1e-2)],
)
def test_one_rank_equals_the_cross_entropy(one_rank_nccl_group, tokens, hidden_size, vocab, dtype, tolerance):
    hidden, weight, targets = make_inputs("cuda", dtype, tokens, hidden_size, vocab, ignored=tokens // 8)
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    loss = liger_vocab_parallel_linear_cross_entropy(
        h, w, targets, 0, vocab, group=one_rank_nccl_group, ignore_index=IGNORE_INDEX
    )
    loss.backward()
    ref_loss, _, ref_hidden, ref_weight = reference(hidden, weight, targets)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=tolerance / 5, atol=0.0)
    assert relative_error(h.grad, ref_hidden) <= tolerance
    assert relative_error(w.grad, ref_weight) <= tolerance
    assert h.grad.dtype == dtype and w.grad.dtype == dtype
