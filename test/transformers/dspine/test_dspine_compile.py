"""torch.compile of a DSpine drafter training step: the eager loss and gradients.

The user's way first: ``draft.compile(backend="aot_eager")`` (``nn.Module.compile``, in place) on a Liger drafter,
built with ``use_liger_kernel=True`` or a native one patched with ``apply_liger_kernel_to_dspine(model=draft)``,
then one objective forward and backward. The objective itself runs eagerly; only the drafter's forward is compiled,
and dynamo captures it whole: one graph, no graph break. The Liger RMSNorm and SiLU-mul kernels are custom ops
(opaque to dynamo, with fake implementations), so they sit inside that graph and run, on a CPU, through Triton's
interpreter; the injection's and the fused MLP's autograd Functions are traced into it.

Then ``torch.compile`` of the whole ``DSpineObjective``. It breaks the graph where it reads a tensor on the host
(anchor count, the alignment CE's guard, the fused kernel's label check), which is allowed here: loss and gradients
must still be the eager ones.

fp32 on a CPU: ``aot_eager`` runs the captured ops as they are; the losses came out bit-equal and the gradients
equal up to rounding (at most about 4e-9, on the spine's parameters only): rtol 1e-5, atol 1e-6, as tight as the
other fp32 tests. bf16 on CUDA: the tolerance of test_dspine_liger.py (0.02).
"""

import pytest
import torch
from torch._dynamo.backends.registry import lookup_backend
from torch._dynamo.utils import counters
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from liger_dspine import apply_liger_kernel_to_dspine
from liger_dspine.models.dspine import DSpineDraftModel
from liger_dspine.models.dspine import DSpineObjective
from liger_dspine.modules.rms_norm import LigerRMSNorm
from tiny_dspine import TINY_MASK_TOKEN
from tiny_dspine import seeded_draft
from tiny_dspine import target_batch
from tiny_dspine import tiny_draft_config
from tiny_dspine import tiny_target
from tiny_dspine import to_device

pytestmark = pytest.mark.slow  # dynamo and inductor over the interpreter: minutes: make test-slow

pytest.importorskip("liger_kernel")

DEVICES = [
    pytest.param("cpu", torch.float32, dict(rtol=1e-5, atol=1e-6), id="cpu-fp32"),
    pytest.param("cuda", torch.bfloat16, dict(rtol=0.02, atol=0.02), id="cuda-bf16", marks=pytest.mark.cuda),
]
# The Liger kernels the compiled drafter's graph must call (forward and backward).
KERNEL_OPS = {
    "liger_dspine.rms_norm.default",
    "liger_dspine.rms_norm_backward.default",
    "liger_dspine.silu_mul.default",
    "liger_dspine.silu_mul_backward_.default",
}
STEP = 100  # the replacement draw is on at step 100 of 600: the teacher-forced branch runs too


def build_draft(target, kind, device, dtype):
    """A Liger drafter: ``built`` with use_liger_kernel=True, or a native one ``patched`` at instance level."""
    config = tiny_draft_config(head_dim=16, num_attention_heads=2, num_key_value_heads=1)
    native = seeded_draft(target, config, seed=321)
    if kind == "built":
        draft = DSpineDraftModel(config, use_liger_kernel=True)
        draft.load_state_dict(native.state_dict(), strict=True)
    else:
        draft = native
        apply_liger_kernel_to_dspine(model=draft)
    assert not any(isinstance(module, (Qwen3RMSNorm, Qwen3MLP)) for module in draft.modules())
    return to_device(draft, device, dtype)


def target_and_batch(device, dtype):
    """The tiny frozen target and one captured batch of two rows of 10 tokens (two unsupervised)."""
    target = tiny_target(dtype=dtype).to(device)
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, TINY_MASK_TOKEN, (2, 10), generator=generator)
    loss_mask = torch.ones(2, 10)
    loss_mask[0, :2] = 0
    return target, target_batch(target, input_ids.to(device), loss_mask.to(device)).as_kwargs()


def make_objective(draft, target, fused):
    objective = DSpineObjective(
        draft,
        target.lm_head,
        target.model.embed_tokens,
        num_anchors=3,
        objective_chunk_blocks=2,
        fused_objective=fused,
    )
    return objective.train()


def loss_and_grads(objective, batch, run=None):
    """One training step from seed 7 (the anchor and replacement draws): (loss, {name: grad} of the drafter)."""
    torch.manual_seed(7)
    out = (objective if run is None else run)(**batch, global_step=STEP, total_steps=600)
    out.loss.backward()
    grads = {name: p.grad.float().clone() for name, p in objective.draft_model.named_parameters() if p.grad is not None}
    return out.loss.detach().float(), grads


def assert_same_step(compiled, eager, tolerance):
    (loss, grads), (eager_loss, eager_grads) = compiled, eager
    torch.testing.assert_close(loss, eager_loss, **tolerance)
    assert grads.keys() == eager_grads.keys()
    for name, grad in eager_grads.items():
        assert grad.abs().sum() > 0, name  # every parameter is trained by this step
        torch.testing.assert_close(grads[name], grad, **tolerance, msg=lambda m, name=name: f"{name}: {m}")


def kernel_calls(graphs):
    """{op: calls} of the Liger kernel ops in the captured graphs and their nested subgraphs."""
    calls = {}
    for graph in graphs:
        for module in graph.modules():
            if isinstance(module, torch.fx.GraphModule):
                for node in module.graph.nodes:
                    if node.op == "call_function" and str(node.target).startswith("liger_dspine."):
                        calls[str(node.target)] = calls.get(str(node.target), 0) + 1
    return calls


@pytest.mark.parametrize("device, dtype, tolerance", DEVICES)
@pytest.mark.parametrize("kind", ["built", "patched"])
def test_compiled_drafter_gives_the_eager_loss_and_grads_in_one_graph(kind, device, dtype, tolerance):
    target, batch = target_and_batch(device, dtype)
    eager = loss_and_grads(make_objective(build_draft(target, kind, device, dtype), target, None), batch)

    draft = build_draft(target, kind, device, dtype)
    graphs = []

    def aot_eager(graph, example_inputs):  # "aot_eager" itself, keeping the graphs it is given
        graphs.append(graph)
        return lookup_backend("aot_eager")(graph, example_inputs)

    torch._dynamo.reset()
    counters.clear()
    draft.compile(backend=aot_eager)
    compiled = loss_and_grads(make_objective(draft, target, None), batch)

    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1 == len(graphs)
    calls = kernel_calls(graphs)
    assert KERNEL_OPS <= set(calls), calls
    norms = sum(isinstance(m, LigerRMSNorm) for m in draft.modules())
    assert calls["liger_dspine.rms_norm.default"] == norms == 10  # every norm runs its kernel inside the graph
    assert_same_step(compiled, eager, tolerance)


# Graph breaks of the compiled objective, not asserted (dynamo's counters, torch 2.13, the same on every run): 4 breaks
# in 3 graphs with the eager frozen-head terms, 10 in 8 with the fused ones. All read a tensor on the host: the token
# id range in the objective's input checks, int(counts.max()) in max_valid_anchor_count (a batch without anchors
# returns early) and, fused, check_labels' bool(bad.any()) in the fused kernel's input checks.
@pytest.mark.parametrize("device, dtype, tolerance", DEVICES)
@pytest.mark.parametrize("fused", [False, True], ids=["eager_terms", "fused_terms"])
def test_compiled_objective_gives_the_eager_loss_and_grads(fused, device, dtype, tolerance):
    target, batch = target_and_batch(device, dtype)
    eager = loss_and_grads(make_objective(build_draft(target, "built", device, dtype), target, fused), batch)

    objective = make_objective(build_draft(target, "built", device, dtype), target, fused)
    torch._dynamo.reset()
    compiled = loss_and_grads(objective, batch, run=torch.compile(objective, backend="aot_eager"))

    assert_same_step(compiled, eager, tolerance)
