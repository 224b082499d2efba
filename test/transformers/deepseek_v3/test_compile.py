"""torch.compile of a patched DeepSeek-V3 on a CPU: the eager loss and gradients, in one graph.

Every kernel the default patch runs is a custom op (opaque to dynamo, with a fake implementation), so dynamo
captures the whole training forward, label check and fused loss included, without a graph break, and the compiled
code calls the kernels through Triton's interpreter. fp32: ``aot_eager`` runs the captured ops as they are (equal
to eager up to 1e-6); inductor fuses and reorders the torch ops between the kernels (1e-5).

Remaining graph breaks, by option (none with the defaults): ``recompute_attention=True`` and the head-grouped
attention of long sequences run outside the graph (``torch.compiler.disable``: their backward runs autograd over
per-group graphs); ``cross_entropy=True``, ``fused_experts=True`` and a ``down_proj`` that is not a plain Linear
(LoRA) call liger-kernel's autograd Functions, whose Triton launches dynamo traces (on a GPU) or cannot trace
(the CPU interpreter).
"""

import copy

import pytest
import torch
from torch._dynamo.utils import counters

from liger_dspine import apply_liger_kernel_to_deepseek_v3
from tiny_models import assert_grads_close
from tiny_models import build_model
from tiny_models import labels_with_ignored
from tiny_models import loss_and_grads
from tiny_models import random_batch
from tiny_models import tiny_deepseek_v3_config

pytestmark = pytest.mark.slow  # dynamo and inductor over the interpreter: minutes: make test-slow

TOLERANCE = {"aot_eager": dict(atol=1e-6, rtol=1e-6), "inductor": dict(atol=1e-5, rtol=1e-5)}


@pytest.fixture(scope="module")
def config():
    return tiny_deepseek_v3_config()


@pytest.fixture(scope="module")
def native_model(config):
    return build_model(config)


@pytest.fixture(scope="module")
def batch(config):
    input_ids, _ = random_batch(config, batch=2, seq=6, seed=7)
    return input_ids, labels_with_ignored(input_ids)


def compiled_loss_and_grads(model, backend, *args, **kwargs):
    """(output, grads, graph breaks, graphs) of one compiled training step."""
    torch._dynamo.reset()
    counters.clear()
    model.zero_grad(set_to_none=True)
    out = torch.compile(model, backend=backend)(*args, **kwargs)
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return out, grads, sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]


@pytest.mark.parametrize(
    "backend, options",
    [
        ("aot_eager", {}),
        ("inductor", {}),
        ("aot_eager", {"vocab_chunked_lce": True}),
        ("aot_eager", {"fused_linear_cross_entropy": False}),
    ],
    ids=["aot_eager", "inductor", "vocab_chunked_lce", "logits_loss"],
)
def test_compiled_patched_model_gives_the_eager_loss_and_grads_in_one_graph(native_model, batch, backend, options):
    input_ids, labels = batch
    model = copy.deepcopy(native_model).train()
    apply_liger_kernel_to_deepseek_v3(model=model, **options)
    eager, eager_grads = loss_and_grads(model, input_ids, labels=labels)
    native, _ = loss_and_grads(copy.deepcopy(native_model).train(), input_ids, labels=labels)
    torch.testing.assert_close(eager.loss, native.loss, atol=1e-5, rtol=1e-5)

    out, grads, breaks, graphs = compiled_loss_and_grads(model, backend, input_ids, labels=labels)

    assert (breaks, graphs) == (0, 1)
    torch.testing.assert_close(out.loss, eager.loss, **TOLERANCE[backend])
    assert grads.keys() == eager_grads.keys()
    assert_grads_close(grads, eager_grads, **TOLERANCE[backend])


def test_compiled_fp8_patch_gives_the_eager_loss_and_grads_in_one_graph():
    """fp8=True (the CPU reference GEMM on the quantised operands) under aot_eager: the eager FP8 step's numbers."""
    config = tiny_deepseek_v3_config(qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, kv_lora_rank=16)
    input_ids, _ = random_batch(config, batch=1, seq=16, seed=1)
    labels = labels_with_ignored(input_ids)
    model = build_model(config).train()
    apply_liger_kernel_to_deepseek_v3(model=model, fp8=True)
    assert type(model.model.layers[0].self_attn).fp8 and type(model.model.layers[0].mlp).fp8
    eager, eager_grads = loss_and_grads(model, input_ids, labels=labels)

    out, grads, breaks, graphs = compiled_loss_and_grads(model, "aot_eager", input_ids, labels=labels)

    assert (breaks, graphs) == (0, 1)
    torch.testing.assert_close(out.loss, eager.loss, **TOLERANCE["aot_eager"])
    assert grads.keys() == eager_grads.keys()
    assert_grads_close(grads, eager_grads, **TOLERANCE["aot_eager"])


def test_compiled_model_refuses_a_label_outside_the_vocabulary(native_model, batch, config):
    input_ids, labels = batch
    model = copy.deepcopy(native_model).train()
    apply_liger_kernel_to_deepseek_v3(model=model)
    bad = labels.clone()
    bad[0, 2] = config.vocab_size
    torch._dynamo.reset()
    with pytest.raises(ValueError, match=rf"^liger-dspine: labels must be in \[0, {config.vocab_size}\)"):
        torch.compile(model, backend="aot_eager")(input_ids, labels=bad)


def test_compiled_fused_loss_gives_the_same_gradient_on_a_second_backward(native_model, batch):
    """Under compile the fused loss scales a copy of its kept gradients: a retained graph can run twice."""
    input_ids, labels = batch
    model = copy.deepcopy(native_model).train()
    apply_liger_kernel_to_deepseek_v3(model=model, grouped_experts=False, swiglu=False)
    torch._dynamo.reset()
    loss = torch.compile(model, backend="aot_eager")(input_ids, labels=labels).loss * 3.0
    weight = model.lm_head.weight
    (first,) = torch.autograd.grad(loss, weight, retain_graph=True)
    (second,) = torch.autograd.grad(loss, weight)
    torch.testing.assert_close(second, first, atol=0, rtol=0)
    assert first.abs().sum() > 0


def test_compiled_gpu_label_check_waits_after_the_decoder(monkeypatch):
    """On a GPU the compiled step checks its labels in two ops (``modules/label_checks.py``): the bounds' copy to
    the host first, the wait for it just before the loss, after the decoder's kernels are queued. Inductor orders
    ops by their inputs alone, so the wait takes the loss's input as one; here (CPU) the GPU path is forced and the
    generated code's order read."""
    from torch._inductor.utils import run_and_get_code

    from liger_dspine.modules import causal_lm_forward
    from liger_dspine.modules import label_checks

    def gpu_path(labels, vocab_size, ignore_index=-100, shifted=True):
        bounds = label_checks._label_bounds_to_host_op(labels, ignore_index, shifted)
        return labels, lambda after: label_checks._finish_label_check_op(
            labels, bounds, after, vocab_size, ignore_index, shifted
        )

    monkeypatch.setattr(causal_lm_forward, "checked_labels", gpu_path)
    config = tiny_deepseek_v3_config(attn_implementation="sdpa")  # here inductor moved a free-standing wait up
    input_ids, _ = random_batch(config, batch=1, seq=16, seed=3)
    labels = input_ids
    model = build_model(config).train()
    apply_liger_kernel_to_deepseek_v3(model=model)
    eager, _ = loss_and_grads(model, input_ids, labels=labels)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="inductor")
    out, codes = run_and_get_code(lambda: compiled(input_ids, labels=labels))
    torch.testing.assert_close(out.loss, eager.loss, atol=1e-5, rtol=1e-5)
    forward = next(code for code in codes if "label_bounds_to_host" in code)
    order = [forward.index(f"torch.ops.liger_dspine.{op}.default") for op in ("label_bounds_to_host", "rms_norm")]
    wait = forward.index("torch.ops.liger_dspine.finish_label_check.default")
    last_norm = forward.rindex("torch.ops.liger_dspine.rms_norm.default")
    loss = forward.index("torch.ops.liger_dspine.fused_linear_cross_entropy.default")
    assert order[0] < order[1] < last_norm < wait < loss
