"""Kernels compiled for an H100 / H200 (sm_90) on a machine without a GPU.

Triton's interpreter runs what its compiler refuses (a plain global read inside a kernel, say), so the CPU tests
alone can pass kernels that fail on every GPU. Here each kernel goes through Triton's whole CUDA pipeline (TTIR to
cubin, with its bundled ptxas) for sm_90 at the launch settings the ops use, in a process without the interpreter.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

# (module, kernel, signature, constexprs, warps): bf16 data, the widths of the DSpine benchmarks
KERNELS = [
    ("scaled_write", "_scaled_write_kernel",
     {"states_ptr": "*bf16", "delta_ptr": "*bf16", "out_ptr": "*bf16", "rms_ptr": "*fp32", "hidden": "i32",
      "root_hidden": "fp32"}, {"BLOCK_H": 8192}, 16),
    ("scaled_write", "_scaled_write_backward_kernel",
     {"grad_ptr": "*bf16", "delta_ptr": "*bf16", "states_ptr": "*bf16", "rms_ptr": "*fp32", "grad_states_ptr": "*bf16",
      "grad_delta_ptr": "*bf16", "hidden": "i32"}, {"BLOCK_H": 4096}, 8),
    ("scaled_write", "_unit_feature_kernel",
     {"projected_ptr": "*bf16", "out_ptr": "*bf16", "inverse_ptr": "*fp32", "rank": "i32", "scale": "fp32",
      "eps": "fp32"}, {"BLOCK_R": 1024}, 2),
    ("scaled_write", "_unit_feature_backward_kernel",
     {"grad_ptr": "*bf16", "projected_ptr": "*bf16", "inverse_ptr": "*fp32", "grad_projected_ptr": "*bf16",
      "rank": "i32", "scale": "fp32", "limit": "fp32"}, {"BLOCK_R": 1024}, 2),
    ("frozen_head_candidates", "_frozen_head_candidates_kernel",
     {"draft_logits_ptr": "*bf16", "teacher_logits_ptr": "*bf16", "sub_max_ptr": "*fp32", "teacher_lse_ptr": "*fp32",
      "ids_ptr": "*i64", "probs_ptr": "*fp32", "vocab_size": "i32", "num_sub": "i32"},
     {"TOP_K": 16, "BLOCK_K": 16, "BLOCK_S": 1024, "SUB": 256}, 4),
]  # fmt: skip

_COMPILE = textwrap.dedent(
    """
    import importlib, json, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, kernel, signature, constexprs, warps = json.loads(sys.argv[1])
    fn = getattr(importlib.import_module("liger_dspine.ops." + module), kernel)
    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    compiled = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": warps},
    )
    print(len(compiled.asm["cubin"]))
    """
)


@pytest.mark.parametrize("spec", KERNELS, ids=lambda spec: spec[1])
def test_kernel_compiles_for_sm90(spec, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LIGER_DSPINE_INTERPRET")}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE, json.dumps(spec)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) > 0  # a cubin came out
