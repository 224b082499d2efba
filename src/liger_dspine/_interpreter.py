"""Running Triton kernels on a CPU through Triton's interpreter (tests and the CPU demo only).

Enable it with ``LIGER_DSPINE_INTERPRET=1`` in the environment (read when ``liger_dspine`` is imported), or by
calling :func:`enable_cpu_interpreter`, in either case before the first patch is applied. Triton decorates a kernel
when its module is imported, and only kernels decorated while ``TRITON_INTERPRET=1`` is set run through the
interpreter: kernels already decorated for the compiler (``triton.language``'s helpers, which transformers imports
through ``torch._dynamo``, and liger-kernel's or this package's kernel modules imported before) are turned into
interpreted ones in place, so the import order does not matter.

Gaps of the interpreter filled here:
- Python float kernel arguments arrive as plain floats, so ``eps.to(tl.float32)`` fails: they are wrapped as fp32
  scalars, as the compiler does.
- Triton 3.6 turns a scalar into a Python int (``range(0, n, BLOCK)`` over an int argument) with ``int()`` of a
  one-element array, which NumPy 2.4 refuses; it is read as a scalar, as Triton 3.9 does.
- ``libdevice.rsqrt`` and ``libdevice.tanh`` are declarations without a body: they are mapped to ``tl`` functions.
- The interpreter holds bf16 values as their 16-bit patterns and computes on those integers (NaN or wrong numbers,
  with at most NumPy warnings): every interpreted launch, liger-kernel's and this package's, refuses a bf16 tensor
  argument before the kernel runs. fp32 and fp16 are computed right.
"""

import os
import sys

ENV_FLAG = "LIGER_DSPINE_INTERPRET"
_KERNEL_MODULE_PREFIXES = ("liger_kernel.ops", "liger_dspine.ops")
_enabled = False

HOW_TO_ENABLE = (
    f"set {ENV_FLAG}=1 in the environment before importing liger_dspine (or call "
    "liger_dspine.enable_cpu_interpreter() before the first patch is applied); it runs the Triton kernels through "
    "Triton's interpreter, which is slow and meant for tests"
)


def enable_from_environment() -> None:
    if os.environ.get(ENV_FLAG, "").strip().lower() in ("1", "true", "yes", "on"):
        enable_cpu_interpreter()


def enable_cpu_interpreter() -> None:
    """Route every Triton kernel of liger-kernel and liger-dspine through Triton's interpreter."""
    global _enabled
    if _enabled:
        return
    os.environ["TRITON_INTERPRET"] = "1"
    # The fused-MoE autotuner needs a GPU driver.
    os.environ["LIGER_FUSED_MOE_AUTOTUNE"] = "0"
    _patch_float_arguments()
    _patch_scalar_index()
    replaced = _patch_libdevice()
    _interpret_decorated_kernels(replaced)
    _patch_bf16_refusal()
    _enabled = True


def _interpret_decorated_kernels(replaced: dict) -> None:
    """Turn the kernels decorated for Triton's compiler before the switch into interpreted ones, in place.

    Kernels are module attributes (``tl.sigmoid``, ``_rms_norm_forward_kernel``), possibly wrapped by ``autotune`` /
    ``heuristics``; a kernel module that imported another's kernel holds the same object, so one mapping from each
    compiled kernel to its interpreted twin is applied to every attribute of the modules concerned. ``replaced`` maps
    the libdevice declarations (by id) to their stand-ins, for kernel modules that imported them by name.
    """
    if "triton" not in sys.modules:
        return
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    from triton.runtime.jit import KernelInterface

    prefixes = ("triton.language",) + _KERNEL_MODULE_PREFIXES
    modules = [module for name, module in list(sys.modules.items()) if name.startswith(prefixes) and module]
    twins: dict[int, InterpretedFunction] = {}

    def interpreted(value):
        if id(value) in replaced:
            return replaced[id(value)]
        if type(value) is JITFunction or (isinstance(value, JITFunction) and hasattr(value, "fn")):
            if id(value) not in twins:
                twins[id(value)] = InterpretedFunction(value.fn)
            return twins[id(value)]
        return None

    for module in modules:
        if getattr(module, "_INTERPRETED", None) is False:  # a kernel module's record of how its kernels were decorated
            module._INTERPRETED = True
        for name, value in list(vars(module).items()):
            twin = interpreted(value)
            if twin is not None:
                setattr(module, name, twin)
            elif isinstance(value, KernelInterface) and not isinstance(value, InterpretedFunction):
                # autotune / heuristics wrappers: their innermost fn is the decorated kernel
                wrapper = value
                while isinstance(getattr(wrapper, "fn", None), KernelInterface):
                    inner = interpreted(wrapper.fn)
                    if inner is not None:
                        wrapper.fn = inner
                        break
                    wrapper = wrapper.fn


def _patch_float_arguments() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter._implicit_cvt, "_liger_dspine", False):
        return
    original = interpreter._implicit_cvt

    def implicit_cvt(arg):
        if isinstance(arg, float):
            handle = interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32)
            return tl.tensor(handle, tl.float32)
        return original(arg)

    implicit_cvt._liger_dspine = True
    interpreter._implicit_cvt = implicit_cvt


def _patch_scalar_index() -> None:
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_liger_dspine", False):
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(())))

    patch_lang_tensor._liger_dspine = True
    interpreter._patch_lang_tensor = patch_lang_tensor


def _patch_libdevice() -> dict:
    """Map libdevice's body-less ``rsqrt`` and ``tanh`` to ``tl`` functions; returns {id(declaration): stand-in}."""
    replacements = {"rsqrt": _rsqrt, "tanh": _tanh}
    replaced = {}
    for name in ("triton.language.extra.libdevice", "triton.language.extra.cuda.libdevice"):
        try:
            module = __import__(name, fromlist=["_"])
        except ImportError:
            continue
        for fn_name, fn in replacements.items():
            original = getattr(module, fn_name, None)
            if original is not None and original is not fn:
                replaced[id(original)] = fn
            setattr(module, fn_name, fn)
    return replaced


def bf16_refusal(kernel: str, argument: str) -> str:
    return (
        "liger-dspine: bfloat16 tensors cannot run through Triton's CPU interpreter, which computes bfloat16 on the "
        f"integers of its bit patterns (NaN or wrong numbers; kernel {kernel}, argument {argument}); use float32 (or "
        "float16) on CPU, or a GPU"
    )


def _patch_bf16_refusal() -> None:
    """Every interpreted launch (``kernel[grid](...)``, autotuned or not) reaches ``InterpretedFunction.run``."""
    from triton.runtime import interpreter

    original = interpreter.InterpretedFunction.run
    if getattr(original, "_liger_dspine", False):
        return

    def run(self, *args, **kwargs):
        if not kwargs.get("warmup", False):
            launched = {**dict(zip(self.arg_names, args)), **kwargs}
            for name, value in launched.items():
                if _holds_bf16(value):
                    raise RuntimeError(bf16_refusal(self.__name__, name))
        return original(self, *args, **kwargs)

    run._liger_dspine = True
    interpreter.InterpretedFunction.run = run


def _holds_bf16(value) -> bool:
    import torch
    import triton.language as tl

    if isinstance(value, (tuple, list)):
        return any(_holds_bf16(item) for item in value)
    # torch tensors, and Triton's reinterpreting wrappers (their dtype a Triton type)
    return hasattr(value, "data_ptr") and getattr(value, "dtype", None) in (torch.bfloat16, tl.bfloat16)


def _rsqrt(x):
    # Resolved at call time: inside an interpreted kernel ``tl`` is bound to the interpreter's builder.
    import triton.language as tl

    return tl.rsqrt(x)


def _tanh(x):
    # Runs inside interpreted kernels, where ``tl`` operates on NumPy-backed tensors.
    import triton.language as tl

    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


def is_interpreted(kernel) -> bool:
    """Whether the Triton ``kernel`` was decorated under the interpreter (``TRITON_INTERPRET=1`` when its module was
    imported)."""
    import triton

    return not isinstance(kernel, triton.runtime.JITFunction)


def kernel_runs_on(tensor, kernel) -> bool:
    """Whether the Triton ``kernel`` can run on ``tensor``'s device: CUDA, or a CPU when the kernel is interpreted."""
    return tensor.is_cuda or (tensor.device.type == "cpu" and is_interpreted(kernel))


def check_kernel_device(tensor, what: str) -> None:
    """Fail clearly when a CPU tensor reaches a compiled Triton kernel."""
    if tensor.device.type == "cpu" and not _enabled:
        raise RuntimeError(
            f"liger-dspine: {what} got a CPU tensor, and Triton kernels need a GPU. To run on a CPU, {HOW_TO_ENABLE}."
        )
