"""Two refusals of the patched tiny DeepSeek-V3 (default patch):

- bf16 tensors reaching a Triton kernel through the CPU interpreter (which computes bf16 on the integers of its bit
  patterns: NaN losses) are an error naming the kernel, liger-kernel's kernels and this package's alike; fp16 still
  runs (checked against fp32 with fp16's rounding, 2**-10 relative);
- a second backward pass through one graph is refused at the model's output (the loss, or the logits a loss was
  computed from), before any ``.grad`` changes, also where the fused loss itself would allow it (an upstream
  gradient of exactly 1) and the fused SwiGLU MLP cannot run its backward again.
"""

import pytest
import torch
import torch.nn.functional as F

from liger_dspine import apply_liger_kernel_to_deepseek_v3
from liger_dspine.ops.interleaved_rope import liger_interleaved_rope_single
from liger_dspine.ops.liger_kernel_ops import liger_rms_norm
from tiny_models import build_model
from tiny_models import random_batch
from tiny_models import tiny_deepseek_v3_config

BF16_REFUSED = r"^liger-dspine: bfloat16 tensors cannot run through Triton's CPU interpreter, .*kernel {kernel}, "
BF16_ADVICE = "use float32 (or float16) on CPU, or a GPU"
SWIGLU_SPENT = r"^liger-dspine: the fused SwiGLU MLP \(LigerSwiGLUMLP\) can run its backward only once"
LOSS_SCALED = r"^liger-dspine: this loss was already back-propagated once"

cpu_interpreter = pytest.mark.skipif(torch.cuda.is_available(), reason="a refusal of the CPU interpreter")


def patched_model(dtype=torch.float32):
    config = tiny_deepseek_v3_config()
    model = build_model(config, dtype=dtype).train()
    apply_liger_kernel_to_deepseek_v3(model=model)
    return model, config


# ------------------------------------------------------------------------------------------------------- bf16 on CPU
@cpu_interpreter
def test_a_bf16_model_is_refused_instead_of_a_nan_loss():
    model, config = patched_model(torch.bfloat16)
    input_ids, labels = random_batch(config)
    with pytest.raises(RuntimeError, match=BF16_REFUSED.format(kernel=r"\w+")) as error:  # the first kernel run
        model(input_ids, labels=labels)
    assert str(error.value).endswith(BF16_ADVICE) and "\n" not in str(error.value)


@cpu_interpreter
def test_liger_kernels_and_this_packages_refuse_bf16():
    x = torch.randn(3, 4, 16, 8).bfloat16()
    with pytest.raises(RuntimeError, match=BF16_REFUSED.format(kernel="_rms_norm_forward_kernel")):
        liger_rms_norm(x, torch.ones(8, dtype=torch.bfloat16), 1e-6)
    angles = torch.rand(1, 16, 4)
    with pytest.raises(RuntimeError, match=BF16_REFUSED.format(kernel="_rope_rows_kernel")):
        liger_interleaved_rope_single(x, angles.cos().bfloat16(), angles.sin().bfloat16())


@cpu_interpreter
def test_fp16_still_runs_through_the_interpreter():
    torch.manual_seed(0)
    x, weight = torch.randn(5, 32), torch.rand(32) + 0.5
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
    actual = liger_rms_norm(x.half(), weight.half(), 1e-6)
    assert actual.dtype == torch.float16
    # fp16 inputs and output: a few roundings of 2**-11 relative each
    torch.testing.assert_close(actual.float(), expected, atol=2e-3, rtol=2**-10)


# -------------------------------------------------------------------------------------------- second backward pass
def grads(model) -> dict:
    return {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}


def same_grad(a, b) -> bool:
    return a is None and b is None or a is not None and b is not None and torch.equal(a, b)


def assert_grads_unchanged(model, first: dict) -> None:
    after = grads(model)
    assert after.keys() == first.keys()
    changed = [name for name, grad in first.items() if not same_grad(grad, after[name])]
    assert not changed, f"changed by the refused pass: {changed}"


def logits_loss(model, input_ids, labels):
    logits = model(input_ids).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


@pytest.mark.parametrize(
    "loss_of, refused",
    [
        (lambda model, ids, labels: model(ids, labels=labels).loss, LOSS_SCALED),
        # an upstream gradient of exactly 1: the fused loss rescales nothing, the fused SwiGLU MLP cannot run again
        (lambda model, ids, labels: model(ids, labels=labels, num_items_in_batch=1).loss, SWIGLU_SPENT),
        (lambda model, ids, labels: model(ids, labels=labels, skip_logits=False).loss, SWIGLU_SPENT),
        (logits_loss, SWIGLU_SPENT),
    ],
    ids=["fused_loss", "fused_loss_unscaled", "loss_from_logits", "logits"],
)
def test_a_second_backward_changes_no_gradient(loss_of, refused):
    model, config = patched_model()
    input_ids, labels = random_batch(config)
    loss = loss_of(model, input_ids, labels)
    loss.backward(retain_graph=True)
    first = grads(model)
    assert first["lm_head.weight"] is not None and first["model.norm.weight"] is not None
    with pytest.raises(RuntimeError, match=refused):
        loss.backward()
    assert_grads_unchanged(model, first)


def test_autograd_grad_of_the_head_alone_then_backward_runs_once_more():
    """A pass that ran no fused SwiGLU backward (autograd.grad of lm_head.weight only) leaves the next one allowed:
    its gradients equal those of a fresh forward (upstream gradient 1: the fused loss rescaled nothing)."""
    model, config = patched_model()
    input_ids, labels = random_batch(config)
    loss = model(input_ids, labels=labels, num_items_in_batch=1).loss
    (head_grad,) = torch.autograd.grad(loss, model.lm_head.weight, retain_graph=True)
    loss.backward()
    again = grads(model)
    model.zero_grad(set_to_none=True)
    model(input_ids, labels=labels, num_items_in_batch=1).loss.backward()
    assert torch.equal(head_grad, model.lm_head.weight.grad)
    assert all(torch.equal(again[n], p.grad) for n, p in model.named_parameters() if p.grad is not None)
