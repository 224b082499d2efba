"""Every kernel the ops launch, compiled for an H100 / H200 (sm_90) on a machine without a GPU.

Triton's interpreter runs what its compiler refuses (a plain global read inside a kernel, say), so the CPU tests
alone can pass kernels that fail on every GPU. Here the op cases of ``test_fake_impls`` (and the top-k kernel, which
their tiny vocabularies do not reach) run once through the interpreter while each launch of a liger-dspine kernel is
recorded (its argument types, constexpr values and launch options); then each distinct launch goes through Triton's
whole CUDA pipeline (TTIR to cubin, with its bundled ptxas) for sm_90, in a process without the interpreter.
"""

import inspect
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import triton.language as tl
from test_fake_impls import CASES
from test_fake_impls import run_case
from triton.runtime import interpreter

from liger_dspine.ops.frozen_head_candidates import top_candidates
from liger_dspine.ops.frozen_head_kernels import chunk_stats

_POINTER_TYPES = {
    torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
    torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5",
}  # fmt: skip
_OPTIONS = ("num_warps", "num_stages")


def _constexpr_names(fn) -> set[str]:
    return {
        name
        for name, parameter in inspect.signature(fn).parameters.items()
        if parameter.annotation is tl.constexpr or parameter.annotation == "tl.constexpr"
    }


def _encode(value):
    """A constexpr value as JSON: tl dtypes by name."""
    if isinstance(value, tl.dtype):
        return {"tl_dtype": value.name}
    return value


def _argument_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _POINTER_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def recorded_launches() -> list[dict]:
    """The distinct launches of liger-dspine kernels made by the op cases, as compile specs."""
    launches = {}
    run = interpreter.InterpretedFunction.run

    def recording(self, *args, grid, warmup, **kwargs):
        fn = self.fn
        if fn.__module__.startswith("liger_dspine."):
            constexprs = _constexpr_names(fn)
            values = {**dict(zip(self.arg_names, args)), **kwargs}
            spec = {
                "module": fn.__module__,
                "kernel": fn.__name__,
                "signature": {
                    name: "constexpr" if name in constexprs else _argument_type(values[name])
                    for name in self.arg_names
                    if name in values
                },
                "constexprs": {name: _encode(values[name]) for name in self.arg_names if name in constexprs},
                "options": {name: kwargs[name] for name in _OPTIONS if name in kwargs},
            }
            launches.setdefault(json.dumps(spec, sort_keys=True), spec)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = recording
    try:
        for case in CASES:
            run_case(case)
        # The top-k kernel, and the stats kernel that makes the top-k and dz itself: a vocabulary above K x 256,
        # which the cases' is not.
        logits, labels, scale = torch.randn(2, 600), torch.zeros(2, dtype=torch.int64), torch.ones(2)
        top_candidates(logits, logits, logits.view(2, 1, 600)[..., :3].contiguous(), logits[:, 0].contiguous(), 2, 256)
        chunk_stats(logits.clone(), logits, labels, top_k=2, grad_scales=(scale, scale))
    finally:
        interpreter.InterpretedFunction.run = run
    return list(launches.values())


_COMPILE = textwrap.dedent(
    """
    import importlib, json, sys
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    failed = []
    for spec in json.loads(sys.stdin.read()):
        kernel = getattr(importlib.import_module(spec["module"]), spec["kernel"])
        while not isinstance(kernel, JITFunction):
            kernel = kernel.fn  # autotune / heuristics wrappers
        constexprs = {
            name: getattr(tl, value["tl_dtype"]) if isinstance(value, dict) else value
            for name, value in spec["constexprs"].items()
        }
        source = ASTSource(fn=kernel, signature=spec["signature"], constexprs=constexprs)
        try:
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=spec["options"])
            assert compiled.asm["cubin"]
        except Exception as error:
            failed.append(f"{spec['module']}.{spec['kernel']}: {str(error)[-1500:]}")
    print(json.dumps(failed))
    """
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the kernels themselves")
def test_every_launched_kernel_compiles_for_sm90(tmp_path):
    specs = recorded_launches()
    kernels = {(spec["module"], spec["kernel"]) for spec in specs}
    assert len(kernels) >= 40, sorted(kernels)  # the cases reach the package's kernels
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LIGER_DSPINE_INTERPRET")}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE], input=json.dumps(specs), env=env, capture_output=True, text=True, timeout=1200
    )
    assert done.returncode == 0, done.stderr[-3000:]
    failed = json.loads(done.stdout.splitlines()[-1])
    assert not failed, "\n".join(failed)
