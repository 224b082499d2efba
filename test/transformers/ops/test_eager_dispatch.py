"""Custom ops whose eager calls skip the dispatcher: the direct path is taken exactly when nothing else would see
the call, gives the op's results, and bumps the version of what it mutates."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from liger_dspine.ops.eager_dispatch import _direct_call_allowed
from liger_dspine.ops.eager_dispatch import liger_custom_op

CALLS = []


@liger_custom_op("liger_dspine_test::scaled_copy", mutates_args=())
def scaled_copy(x: torch.Tensor, scale: float) -> torch.Tensor:
    CALLS.append(type(x))
    return x * scale


@scaled_copy.register_fake
def _(x, scale):
    return torch.empty_like(x)


@liger_custom_op("liger_dspine_test::add_into_", mutates_args=("out",))
def add_into_(out: torch.Tensor, x: torch.Tensor) -> None:
    out.add_(x)


@add_into_.register_fake
def _(out, x):
    return None


def test_eager_call_runs_the_implementation_and_matches_the_op():
    x = torch.randn(3, 4)
    CALLS.clear()
    direct = scaled_copy(x, 2.0)
    through_dispatcher = torch.ops.liger_dspine_test.scaled_copy(x, 2.0)
    assert torch.equal(direct, x * 2.0) and torch.equal(through_dispatcher, direct)
    assert CALLS == [torch.Tensor, torch.Tensor]


def test_fake_tensors_take_the_fake_implementation():
    CALLS.clear()
    with FakeTensorMode():
        out = scaled_copy(torch.empty(5, 2), 3.0)
    assert out.shape == (5, 2) and CALLS == []


@pytest.mark.parametrize("by_keyword", [False, True])
def test_direct_call_bumps_the_version_of_a_mutated_argument(by_keyword):
    out, x = torch.zeros(4), torch.ones(4)
    before = out._version
    if by_keyword:
        add_into_(out=out, x=x)
    else:
        add_into_(out, x)
    assert out._version > before and torch.equal(out, torch.ones(4))


def test_a_tensor_saved_for_backward_then_mutated_is_caught():
    leaf = torch.randn(4, requires_grad=True)
    squared = leaf * 1.0
    loss = (squared * squared).sum()  # saves `squared`
    with torch.no_grad():
        add_into_(squared, torch.ones(4))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_when_the_direct_path_is_allowed():
    x = torch.randn(2)
    param = torch.nn.Parameter(torch.randn(2))
    assert _direct_call_allowed((x, 1.0, "a"), {})
    assert _direct_call_allowed((x,), {"w": [x, x], "flag": True})
    assert not _direct_call_allowed((param,), {}), "a tensor that needs a gradient under grad mode"
    with torch.no_grad():
        assert _direct_call_allowed((param,), {})
    assert not _direct_call_allowed((x,), {"w": [x, x.detach().requires_grad_()]})
    with torch.device("cpu"):  # a torch-function mode
        assert not _direct_call_allowed((x,), {})
    with FakeTensorMode() as mode:
        assert not _direct_call_allowed((x,), {})
        fake = mode.from_tensor(x)
    assert not _direct_call_allowed((fake,), {}), "a tensor subclass"


def test_a_tensor_needing_a_gradient_goes_through_the_op():
    """No autograd formula is registered for the test op: torch refuses it, the direct path would have dropped the
    gradient silently."""
    x = torch.randn(3, requires_grad=True)
    CALLS.clear()
    with pytest.raises(RuntimeError, match="autograd"):
        scaled_copy(x, 2.0).sum().backward()


def test_jit_trace_records_the_op():
    traced = torch.jit.trace(lambda x: scaled_copy(x, 2.0), torch.randn(3))
    assert "liger_dspine_test::scaled_copy" in str(traced.graph)
    x = torch.randn(3)
    assert torch.equal(traced(x), x * 2.0)


def test_mutated_arguments_must_be_named():
    with pytest.raises(ValueError, match="must name the arguments"):
        liger_custom_op("liger_dspine_test::bad", mutates_args="unknown")


def test_meta_tensors_run_the_fake_and_a_meta_weight_beside_data_is_refused():
    """All on the meta device (shape inference): the fake implementation, no kernel. A meta weight beside a tensor
    with data (a weight an offloading hook has not loaded) would send a null pointer to a kernel: a clear error."""
    CALLS.clear()
    out = scaled_copy(torch.empty(3, 4, device="meta"), 2.0)
    assert out.device.type == "meta" and out.shape == (3, 4) and CALLS == []
    with pytest.raises(ValueError, match=r"liger_dspine_test::add_into_ got tensors on the meta device .* beside "):
        add_into_(torch.zeros(3, 4), torch.empty(3, 4, device="meta"))
    assert not _direct_call_allowed((torch.empty(2, device="meta"),), {})
