"""Mini models trained with liger-dspine's default patch and with ``fp8=True`` from the same weights on the same
batches: per-step losses and the whole model's training update agree within what e4m3's rounding allows.

fp32 on a CPU, DeepSeek-V3 (FP8's reference path: the fp8 values multiplied in fp32); bf16 on CUDA, where FP8
GEMMs run (compute capability 9.0 / 10.0), for DeepSeek-V3, DeepSeek-V2 and GLM-4.7-Flash.
"""

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from liger_dspine import apply_liger_kernel_to_deepseek_v3  # noqa: E402
from liger_dspine.ops import fp8_quantize  # noqa: E402
from tiny_family import CASES  # noqa: E402
from tiny_models import build_model  # noqa: E402
from tiny_models import tiny_deepseek_v3_config  # noqa: E402
from tiny_models import train_on_batches  # noqa: E402

STEPS = 8
# Plain SGD: its update is the sum of the gradients, so the weights carry the gradients' error as it is (AdamW's
# per-coordinate normalisation would hide a gradient off by a constant factor). The rate makes the mini model learn
# its four batches within the eight steps.
LR = 0.3
# every FP8 GEMM's dims multiples of 16 (kv_a_proj_with_mqa: kv_lora_rank + rope; the heads' widths)
FP8_WIDTHS = dict(qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, kv_lora_rank=16, q_lora_rank=16)

# e4m3 keeps 3 mantissa bits: a quantised operand is within 2^-4 of its value (relative, normal range), so an FP8
# GEMM's output is within 2 * 2^-4 (its two operands) + 2^-8 (its rounding to bf16) relative to sum |a||b|.
# - Each step's loss: within that bound of the default patch's (test_fp8_option.py holds one step to it).
# - Each parameter's training update W_final - W_initial, norm-wise: a branch's weight gradient comes out of up to
#   three FP8 GEMMs (the input gradients of down and gate/up, then its own weight-gradient GEMM), each adding the
#   bound, as in test_fp8_option.py's gradient check; SGD's update sums the gradients. Beyond that, the weights' own
#   rounding: each step rounds a weight by up to half an ulp in either run (2^-8 relative in bf16, 2^-24 in fp32).
PRODUCT_BOUND = 2 * 2.0**-4 + 2.0**-8
UPDATE_BOUND = 3 * PRODUCT_BOUND


@pytest.fixture
def reference_quantisers(monkeypatch):
    """The quantisers' torch references instead of their Triton kernels: bit-identical (test_fp8_quantize.py holds
    both to the same float64 rounding), and 4x faster on a CPU, where the interpreter runs one program per row."""
    monkeypatch.setattr(fp8_quantize, "_use_kernel", lambda x: False)


def build(model_type: str, dtype: torch.dtype, device: str):
    """(tiny model with FP8-sized widths, its apply function)."""
    if model_type == "deepseek_v3":
        config = tiny_deepseek_v3_config(attn_implementation="eager" if device == "cpu" else "sdpa", **FP8_WIDTHS)
        return build_model(config, dtype=dtype, device=device), apply_liger_kernel_to_deepseek_v3
    case = CASES[model_type]
    return case.build(**FP8_WIDTHS).to(device=device, dtype=dtype), case.apply_fn()


def train(model, batches, steps):
    return train_on_batches(model, batches, steps, torch.optim.SGD(model.parameters(), lr=LR))


def assert_updates_agree(fp8, default, initial, dtype):
    """Each parameter's FP8 update within UPDATE_BOUND of the default patch's, plus both runs' weight rounding."""
    rounding = STEPS * torch.finfo(dtype).eps  # two runs, half an ulp a step each
    for (name, p_fp8), p_default, p_initial in zip(fp8.named_parameters(), default.parameters(), initial.parameters()):
        reference = (p_default - p_initial).detach().float().norm()
        error = (p_fp8 - p_default).detach().float().norm()
        bound = UPDATE_BOUND * reference + rounding * p_default.detach().float().norm()
        assert error <= bound, f"{name}: update off by {error / reference:.3f} of it, bound {bound / reference:.3f}"


def check(model_type: str, dtype: torch.dtype, device: str):
    initial, apply = build(model_type, dtype, device)
    default, fp8 = copy.deepcopy(initial), copy.deepcopy(initial)
    apply(model=default)
    apply(model=fp8, fp8=True)
    generator = torch.Generator().manual_seed(7)
    vocab = initial.config.vocab_size
    batches = [torch.randint(0, vocab, (2, 16), generator=generator).to(device) for _ in range(4)]
    default_losses = train(default, batches, STEPS)
    fp8_losses = train(fp8, batches, STEPS)
    # the same batches again: lower losses, else the comparison would be vacuous
    assert (default_losses[4:] < default_losses[:4]).all(), f"the default run did not learn: {default_losses}"
    assert (fp8_losses != default_losses).any(), "the FP8 GEMMs did not run"
    torch.testing.assert_close(fp8_losses, default_losses, rtol=PRODUCT_BOUND, atol=0)
    assert_updates_agree(fp8, default, initial, dtype)


@pytest.mark.skipif(torch.cuda.is_available(), reason="FP8 on CUDA computes in bf16: the bf16 case")
def test_mini_fp8_fp32(reference_quantisers):
    check("deepseek_v3", torch.float32, "cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("model_type", ["deepseek_v3", "deepseek_v2", "glm4_moe_lite"])
def test_mini_fp8_bf16(model_type):
    check(model_type, torch.bfloat16, "cuda")
