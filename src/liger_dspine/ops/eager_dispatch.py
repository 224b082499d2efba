"""Custom ops that skip torch's dispatcher when nothing needs it, and cost little when something does.

Every kernel of this package is a ``torch.library`` custom op with a fake implementation, so that torch.compile,
FakeTensorMode and export see one opaque op. In plain eager code that machinery only costs time: an op call goes
through the dispatcher, the op's autograd layer, a second dispatch and the output-aliasing check, about 25 us of host
time per call on an H200 host, on top of the Triton launch. A model of two layers at 4096 tokens makes about 40 such
calls a step, and such a step is bound by the host.

:func:`liger_custom_op` defines the op with the schema ``torch.library.custom_op`` infers and returns a callable
that runs the Python implementation directly when that is what the dispatcher would do anyway: not compiling,
exporting or tracing (torch.jit.trace included), no TorchDispatchMode or torch-function mode active, no functorch
transform, every tensor argument a plain tensor (or parameter), and no tensor argument needing a gradient under grad
mode. The direct path bumps the version counter of each mutated argument, as the op would, so autograd still catches
a saved tensor changed in place.

Calls that do go through the dispatcher (a compiled graph calls every op that way) reach the implementation in one
Python hop: it is the op's CompositeExplicitAutograd kernel, the Autograd key keeps torch's C++ fallback (these ops
run inside autograd Functions, whose backward owns the gradient) and only an op that mutates an argument adds a
Python ADInplaceOrView kernel, for the version bump. ``torch.library.custom_op`` adds an autograd Function, a second
dispatch and checks around every call: 15 to 21 us against 5 to 8 us per call on a CPU host.
"""

import inspect

import torch
from torch._C._functorch import peek_interpreter_stack

from liger_dspine.ops.first_order import first_order_only

_PLAIN = (torch.Tensor, torch.nn.Parameter)


_LIBRARIES: dict[str, torch.library.Library] = {}
REGISTERED_OPS: dict[str, "EagerDirectCustomOp"] = {}  # qualified name -> op, every op of liger_custom_op


class EagerDirectCustomOp:
    """A ``torch.library`` custom op whose eager calls run its implementation directly (see the module)."""

    def __init__(self, qualname, op, fn, mutates_args, library):
        self._qualname = qualname
        self._op = op  # the OpOverload
        self._fn = fn
        self._library = library
        self._fake = None
        self._mutated = _mutated_positions(fn, mutates_args)
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn

    def register_fake(self, fake):
        """Register ``fake`` (same signature, outputs of the right shapes on the inputs' device) as the op's fake
        implementation; usable as a decorator."""
        torch.library.register_fake(self._qualname, fake, lib=self._library)
        self._fake = fake
        return fake

    @property
    def fake_impl(self):
        """The registered fake implementation, or None."""
        return self._fake

    @property
    def opoverload(self) -> torch._ops.OpOverload:
        return self._op

    def __call__(self, *args, **kwargs):
        if not _direct_call_allowed(args, kwargs):
            _check_not_partly_meta(self._qualname, args, kwargs)
            if torch.is_grad_enabled() and not torch.compiler.is_compiling():
                needing = [t for t in _tensors(args, kwargs) if t.requires_grad]
                if needing:
                    return self._call_without_gradient_formula(needing, args, kwargs)
            return self._op(*args, **kwargs)
        out = self._fn(*args, **kwargs)
        _bump_versions(self._mutated, args, kwargs)
        return out

    def _call_without_gradient_formula(self, needing, args, kwargs):
        """The op on inputs that need a gradient, under grad mode: its outputs' backward raises (the op has no
        formula of its own; its autograd Function owns the gradient), where torch's fallback would only warn."""
        if self._mutated:
            raise RuntimeError(
                f"liger-dspine: {self._qualname} mutates its arguments and has no autograd formula: call it on "
                "tensors that need no gradient, or under torch.no_grad()"
            )
        return _WithoutGradientFormula.apply(self._qualname, lambda: self._op(*args, **kwargs), *needing)


class _WithoutGradientFormula(torch.autograd.Function):
    """Runs ``call`` (which reads ``tensors``); a backward through its outputs raises."""

    kernel_ops = ()  # the op it runs is the caller's

    @staticmethod
    def forward(ctx, qualname, call, *tensors):
        ctx.qualname = qualname
        return call()

    @staticmethod
    @first_order_only
    def backward(ctx, *grads):
        raise RuntimeError(
            f"liger-dspine: trying to backward through {ctx.qualname}, which has no autograd formula: call it "
            "through its autograd Function"
        )


def liger_custom_op(name: str, *, mutates_args):
    """Define the op ``name`` ("namespace::op") from the decorated function's annotations, as
    ``torch.library.custom_op(name, mutates_args=...)`` would, with the cheaper registration and the eager direct
    path of the module docstring."""
    if isinstance(mutates_args, str):
        raise ValueError(f"liger-dspine: {name} must name the arguments it mutates (got {mutates_args!r})")
    namespace, _, opname = name.partition("::")
    if not namespace or not opname:
        raise ValueError(f"liger-dspine: a custom op name is 'namespace::op', got {name!r}")

    def register(fn):
        library = _LIBRARIES.get(namespace)
        if library is None:
            library = _LIBRARIES[namespace] = torch.library.Library(namespace, "FRAGMENT")
        schema = torch.library.infer_schema(fn, mutates_args=tuple(mutates_args))
        library.define(opname + schema, tags=(torch.Tag.pt2_compliant_tag,))
        library.impl(opname, fn, "CompositeExplicitAutograd")
        op = getattr(getattr(torch.ops, namespace), opname).default
        if mutates_args:
            _register_version_bump(library, opname, op, fn, tuple(mutates_args))
        wrapped = EagerDirectCustomOp(name, op, fn, tuple(mutates_args), library)
        REGISTERED_OPS[name] = wrapped
        return wrapped

    return register


def _register_version_bump(library, opname, op, fn, mutates_args) -> None:
    """An ADInplaceOrView kernel that bumps the version counters of the mutated arguments, then goes on to the
    implementation (what autograd's in-place checks read)."""
    positions = _mutated_positions(fn, mutates_args)
    below = torch._C._after_ADInplaceOrView_keyset

    def bump_then_run(keyset, *args, **kwargs):
        _bump_versions(positions, args, kwargs)
        with torch._C._AutoDispatchBelowADInplaceOrView():
            return op.redispatch(keyset & below, *args, **kwargs)

    library.impl(opname, bump_then_run, "ADInplaceOrView", with_keyset=True)


def _mutated_positions(fn, mutates_args) -> tuple[tuple[str, int], ...]:
    """(name, position) of each argument of ``fn`` named in ``mutates_args``."""
    params = list(inspect.signature(fn).parameters)
    return tuple((name, params.index(name)) for name in mutates_args)


def _bump_versions(positions, args, kwargs) -> None:
    """Bump the version counter of each mutated argument passed (by keyword or by position), as an in-place op does."""
    for name, index in positions:
        mutated = kwargs[name] if name in kwargs else args[index] if index < len(args) else None
        if mutated is not None:
            torch.autograd.graph.increment_version(mutated)


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
