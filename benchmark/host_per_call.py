"""Host time per call of one RMSNorm on [1, 4096, 2048] bf16 by each route (GPU): aten ops, liger-kernel's launch
function, this package's custom op through torch's dispatcher (as a compiled graph calls it) and called directly,
the same implementation defined by ``torch.library.custom_op`` instead, and its autograd Function.

The GPU is held busy by a sleep kernel queued first, so the figures are the host's own cost (no waiting).

    python benchmark/host_per_call.py
"""

import time

import torch
from liger_kernel.ops.rms_norm import rms_norm_forward

from liger_dspine.ops.liger_kernel_ops import LigerRMSNormFunction
from liger_dspine.ops.liger_kernel_ops import _rms_norm


def host_us_per_call(call, calls: int = 200) -> float:
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    torch.cuda._sleep(10**9)
    start = time.perf_counter()
    for _ in range(calls):
        call()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main() -> None:
    x = torch.randn(1, 4096, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(2048, device="cuda", dtype=torch.bfloat16)
    x_grad = x.detach().requires_grad_()
    # the same implementation registered the usual way, for comparison with this package's registration
    custom_op = torch.library.custom_op("liger_dspine_bench::rms_norm", mutates_args=())(_rms_norm.__wrapped__)
    custom_op.register_fake(_rms_norm.fake_impl)
    routes = {
        "one aten multiply": lambda: x * w,
        "F.rms_norm (aten)": lambda: torch.nn.functional.rms_norm(x, (2048,), w, 1e-6),
        "liger-kernel rms_norm_forward": lambda: rms_norm_forward(x, w, 1e-6, 0.0, "llama", None),
        "custom op, through the dispatcher": lambda: _rms_norm.opoverload(x, w, 1e-6, 0.0, "llama"),
        "torch.library.custom_op, dispatcher": lambda: custom_op._opoverload(x, w, 1e-6, 0.0, "llama"),
        "custom op, eager direct call": lambda: _rms_norm(x, w, 1e-6, 0.0, "llama"),
        "autograd Function, input needs grad": lambda: LigerRMSNormFunction.apply(x_grad, w, 1e-6, 0.0, "llama"),
    }
    for name, call in routes.items():
        print(f"{name:40s} {host_us_per_call(call):7.1f} us per call")
    # a compiled graph's forward runs under no_grad, on inputs (parameters) that need gradients
    with torch.no_grad():
        for name, call in {
            "custom op, dispatcher, grad input": lambda: _rms_norm.opoverload(x_grad, w, 1e-6, 0.0, "llama"),
            "torch.library.custom_op, grad input": lambda: custom_op._opoverload(x_grad, w, 1e-6, 0.0, "llama"),
        }.items():
            print(f"{name + ' (no_grad)':40s} {host_us_per_call(call):7.1f} us per call")


if __name__ == "__main__":
    main()
