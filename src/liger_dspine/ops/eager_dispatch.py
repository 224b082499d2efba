"""Custom ops that skip torch's dispatcher when nothing needs it.

Every kernel of this package is a ``torch.library`` custom op with a fake implementation, so that torch.compile,
FakeTensorMode and export see one opaque op. In plain eager code that machinery only costs time: an op call goes
through the dispatcher, the op's autograd layer, a second dispatch and the output-aliasing check, about 25 us of host
time per call on an H200 host, on top of the Triton launch. A model of two layers at 4096 tokens makes about 40 such
calls a step, and such a step is bound by the host.

:func:`liger_custom_op` registers the op as ``torch.library.custom_op`` does and returns a callable that runs the
Python implementation directly when that is what the dispatcher would do anyway: not compiling, exporting or tracing
(torch.jit.trace included), no TorchDispatchMode or torch-function mode active, no functorch transform, every tensor
argument a plain tensor (or parameter), and no tensor argument needing a gradient under grad mode. Otherwise, and for
every attribute (``register_fake``, ...), it is the custom op. The direct path bumps the version counter of each
mutated argument, as the op would, so autograd still catches a saved tensor changed in place.
"""

import inspect

import torch
from torch._C._functorch import peek_interpreter_stack

_PLAIN = (torch.Tensor, torch.nn.Parameter)


class EagerDirectCustomOp:
    """A ``torch.library`` custom op whose eager calls run its implementation directly (see the module)."""

    def __init__(self, op, fn, mutates_args):
        self._op = op
        self._fn = fn
        params = list(inspect.signature(fn).parameters)
        self._mutated = tuple((name, params.index(name)) for name in mutates_args)
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn

    def __getattr__(self, name):
        return getattr(self._op, name)

    def __call__(self, *args, **kwargs):
        if not _direct_call_allowed(args, kwargs):
            _check_not_partly_meta(getattr(self._op, "_qualname", self.__name__), args, kwargs)
            return self._op(*args, **kwargs)
        out = self._fn(*args, **kwargs)
        for name, index in self._mutated:
            mutated = kwargs[name] if name in kwargs else args[index]
            if mutated is not None:
                torch.autograd.graph.increment_version(mutated)
        return out


def liger_custom_op(name: str, *, mutates_args):
    """``torch.library.custom_op(name, mutates_args=...)`` whose eager calls skip the dispatcher (see the module)."""
    if isinstance(mutates_args, str):
        raise ValueError(f"liger-dspine: {name} must name the arguments it mutates (got {mutates_args!r})")

    def register(fn):
        op = torch.library.custom_op(name, mutates_args=mutates_args)(fn)
        return EagerDirectCustomOp(op, fn, tuple(mutates_args))

    return register


def _direct_call_allowed(args, kwargs) -> bool:
    if (
        torch.compiler.is_compiling()
        or torch._C._len_torch_dispatch_stack()
        or torch._C._len_torch_function_stack()
        or peek_interpreter_stack() is not None
        or torch._C._get_tracing_state() is not None
    ):
        return False
    grad = torch.is_grad_enabled()
    for values in (args, kwargs.values()):
        for value in values:
            if isinstance(value, (list, tuple)):
                if not all(_plain(item, grad) for item in value):
                    return False
            elif not _plain(value, grad):
                return False
    return True


def _plain(value, grad: bool) -> bool:
    if not isinstance(value, torch.Tensor):
        return True
    return type(value) in _PLAIN and not (grad and value.requires_grad) and not value.is_meta


def _tensors(args, kwargs):
    for values in (args, kwargs.values()):
        for value in values:
            for item in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(item, torch.Tensor):
                    yield item


def _check_not_partly_meta(name: str, args, kwargs) -> None:
    """Refuse a call mixing tensors with data and tensors on the meta device (a weight not loaded yet: deferred
    initialisation, or an offloading hook that loads it only when its own module is called). A kernel would read
    through a null pointer; all-meta calls run the op's fake implementation."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return
    devices = {t.device.type for t in _tensors(args, kwargs) if type(t) in _PLAIN}
    if "meta" in devices and len(devices) > 1:
        others = ", ".join(sorted(devices - {"meta"}))
        raise ValueError(
            f"liger-dspine: {name} got tensors on the meta device (weights not loaded) beside tensors on {others}; "
            "load or materialise the weights before running the model"
        )
