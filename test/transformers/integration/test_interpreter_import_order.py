"""LIGER_DSPINE_INTERPRET=1 holds whatever was imported before liger_dspine: transformers (which imports
triton.language through torch._dynamo) and liger-kernel's kernel modules, decorated for Triton's compiler."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU interpreter's import order")

SCRIPT = """
import json
import sys

import torch
from transformers import DeepseekV3ForCausalLM  # noqa: F401  (imports triton.language for the compiler)
from liger_kernel.ops.rms_norm import LigerRMSNormFunction  # rsqrt from libdevice, bound at import
from liger_kernel.ops.swiglu import LigerSiLUMulFunction  # tl.sigmoid, a triton.language helper

assert "triton.language" in sys.modules
import liger_dspine  # noqa: E402,F401

torch.manual_seed(0)
x = torch.randn(3, 16)
weight = torch.rand(16) + 0.5
eps = 1e-6
norm = LigerRMSNormFunction.apply(x, weight, eps)
norm_ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
gate, up = torch.randn(3, 16), torch.randn(3, 16)
silu = LigerSiLUMulFunction.apply(gate, up)
silu_ref = torch.nn.functional.silu(gate) * up
print(json.dumps({"norm": (norm - norm_ref).abs().max().item(), "silu": (silu - silu_ref).abs().max().item()}))
"""


def test_environment_variable_holds_after_transformers_and_liger_kernel_were_imported():
    env = {**os.environ, "LIGER_DSPINE_INTERPRET": "1"}
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    errors = json.loads(result.stdout.strip().splitlines()[-1])
    # fp32 on both sides; the interpreter's rsqrt and exp are NumPy's, an ulp or two from torch's
    assert errors["norm"] < 1e-5
    assert errors["silu"] < 1e-5
