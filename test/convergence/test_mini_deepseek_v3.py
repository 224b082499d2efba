"""A mini DeepSeek-V3 trained natively and patched, same seed and data: losses, top-k log-probs, final weights.

fp32 runs everywhere (on a CPU through Triton's interpreter); bf16 runs on CUDA only (the interpreter has no bf16).
"""

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from liger_dspine import apply_liger_kernel_to_deepseek_v3  # noqa: E402
from tiny_models import build_model  # noqa: E402
from tiny_models import tiny_deepseek_v3_config  # noqa: E402
from tiny_models import train_on_batches  # noqa: E402

STEPS = 8
TOP_K = 5

# (loss atol/rtol, top-k log-prob atol, parameter atol/rtol). fp32: kernels reorder fp32 sums (1e-6 level per op);
# AdamW divides each update by the gradient's running RMS, so where a gradient is near zero a 1e-7 difference moves a
# weight by a visible fraction of lr (1e-3): weights get 5e-5 absolute.
# bf16: 8 mantissa bits, activations rounded at every kernel boundary.
TOLERANCES = {
    torch.float32: dict(loss=1e-5, logprob=1e-4, param_atol=5e-5, param_rtol=1e-4),
    torch.bfloat16: dict(loss=2e-2, logprob=1e-1, param_atol=2e-2, param_rtol=2e-2),
}


def train(model, batches, steps):
    return train_on_batches(model, batches, steps, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01))


def run_pair(dtype, device, fused_linear_cross_entropy: bool, seq: int = 16):
    config = tiny_deepseek_v3_config(attn_implementation="eager" if device == "cpu" else "sdpa")
    native = build_model(config, dtype=dtype, device=device)
    patched = copy.deepcopy(native)
    apply_liger_kernel_to_deepseek_v3(fused_linear_cross_entropy=fused_linear_cross_entropy, model=patched)
    generator = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, config.vocab_size, (2, seq), generator=generator).to(device) for _ in range(4)]
    native_losses = train(native, batches, STEPS)
    patched_losses = train(patched, batches, STEPS)
    probe = batches[0]
    native.eval()
    patched.eval()
    with torch.no_grad():
        native_lp = torch.log_softmax(native(input_ids=probe).logits.float(), dim=-1).topk(TOP_K, dim=-1)
        patched_lp = torch.log_softmax(patched(input_ids=probe).logits.float(), dim=-1).topk(TOP_K, dim=-1)
    return native, patched, native_losses, patched_losses, native_lp, patched_lp


def check(dtype, device, fused_linear_cross_entropy):
    tol = TOLERANCES[dtype]
    native, patched, native_losses, patched_losses, native_lp, patched_lp = run_pair(
        dtype, device, fused_linear_cross_entropy
    )
    assert native_losses[-1] < native_losses[0], "the native run did not learn: the comparison would be vacuous"
    torch.testing.assert_close(patched_losses, native_losses, atol=tol["loss"], rtol=tol["loss"])
    torch.testing.assert_close(patched_lp.values, native_lp.values, atol=tol["logprob"], rtol=0)
    for (name, p_native), (_, p_patched) in zip(native.named_parameters(), patched.named_parameters()):
        torch.testing.assert_close(
            p_patched.float(), p_native.float(), atol=tol["param_atol"], rtol=tol["param_rtol"], msg=name
        )


@pytest.mark.parametrize("fused_linear_cross_entropy", [True, False], ids=["fused_lce", "with_logits"])
def test_mini_deepseek_v3_fp32(fused_linear_cross_entropy, device):
    check(torch.float32, device, fused_linear_cross_entropy)


@pytest.mark.cuda
@pytest.mark.parametrize("fused_linear_cross_entropy", [True, False], ids=["fused_lce", "with_logits"])
def test_mini_deepseek_v3_bf16(fused_linear_cross_entropy):
    check(torch.bfloat16, "cuda", fused_linear_cross_entropy)
