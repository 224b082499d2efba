"""On a GPU the patched training step keeps the host off the GPU's back: the backward never synchronises (the fused
loss scales its kept gradients on the device, with liger-kernel's own gradients), and the label check waits only for
its own small reduction while bad labels are still refused before any loss kernel reads them."""

import pytest
import torch

from liger_dspine import apply_liger_kernel_to_deepseek_v3
from liger_dspine.modules import label_checks
from tiny_models import build_model
from tiny_models import random_batch
from tiny_models import tiny_deepseek_v3_config

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def patched_model(**options):
    config = tiny_deepseek_v3_config()
    # bf16: torch's grouped GEMM (the native experts' path) synchronises for fp32 inputs
    model = build_model(config, dtype=torch.bfloat16, device="cuda").train()
    apply_liger_kernel_to_deepseek_v3(model=model, **options)
    return model, config


class no_host_synchronisation:
    """torch's sync debug mode set to raise, for the block (a synchronising CUDA call then fails the test)."""

    def __enter__(self):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")


def test_the_backward_of_a_patched_step_never_synchronises():
    model, config = patched_model()
    input_ids, labels = random_batch(config, device="cuda")
    loss = model(input_ids, labels=labels).loss
    with no_host_synchronisation():
        loss.backward()
    assert model.lm_head.weight.grad.abs().sum() > 0


def test_the_label_check_never_synchronises():
    """It waits on an event recorded after its own reduction, not on the stream or the device."""
    labels = torch.randint(0, 50, (2, 64), device="cuda")
    labels[:, ::5] = -100
    with no_host_synchronisation():
        checked, finish = label_checks.checked_labels(labels, 50)
        assert finish(labels) is labels
    assert checked is labels
    labels[1, 7] = 50
    checked, finish = label_checks.checked_labels(labels, 50)
    with pytest.raises(ValueError, match=r"labels must be in \[0, 50\).*1 label\(s\) are outside"):
        finish(labels)


def test_the_compiled_label_check_never_synchronises():
    """Under torch.compile the check is two ops (the bounds copied to the host, then the wait for that copy): the
    compiled check waits on its event only, and still refuses a bad label."""

    def check(labels):
        _, finish = label_checks.checked_labels(labels, 50)
        return finish(labels * 2) + 0

    compiled = torch.compile(check, fullgraph=True)
    labels = torch.randint(0, 50, (2, 64), device="cuda")
    labels[:, ::5] = -100
    torch.testing.assert_close(compiled(labels), labels)  # compiles
    with no_host_synchronisation():
        out = compiled(labels)
    torch.testing.assert_close(out, labels)
    labels[1, 7] = 50
    with pytest.raises(ValueError, match=r"labels must be in \[0, 50\).*1 label\(s\) are outside"):
        compiled(labels)


def test_fused_loss_gradients_equal_liger_kernels_function():
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    from liger_dspine.ops.liger_kernel_ops import liger_fused_linear_cross_entropy as ours

    torch.manual_seed(0)
    hidden = torch.randn(64, 32, device="cuda", requires_grad=True)
    weight = torch.randn(100, 32, device="cuda", requires_grad=True)
    targets = torch.randint(0, 100, (64,), device="cuda")
    targets[::7] = -100
    scale = 0.37
    loss, accuracy = ours(hidden, weight, targets, -100, 1)
    (loss * scale).backward()
    mine = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    reference = liger_fused_linear_cross_entropy(
        hidden, weight, targets, ignore_index=-100, reduction="sum", return_token_accuracy=True
    )
    (reference.loss * scale).backward()
    assert torch.equal(loss, reference.loss) and torch.equal(accuracy, reference.token_accuracy)
    assert torch.equal(mine[0], hidden.grad) and torch.equal(mine[1], weight.grad)


def test_labels_outside_the_vocabulary_are_refused_on_the_gpu():
    model, config = patched_model()
    input_ids, labels = random_batch(config, device="cuda")
    labels = labels.clone()
    labels[0, 3] = config.vocab_size
    with pytest.raises(ValueError, match=rf"labels must be in \[0, {config.vocab_size}\)"):
        model(input_ids, labels=labels)
    torch.cuda.synchronize()  # no device-side assert was raised by a kernel
