"""Every op of the package under fake tensors: the shapes, dtypes and strides torch.compile sees, without a kernel.

Each case builds tiny inputs with ``torch.randn`` / ``torch.randint`` and calls one op: once for real (through
Triton's interpreter on a CPU) and once inside ``FakeTensorMode``, where the same calls make fake tensors. Outputs
and input gradients (for ones as the output gradients) must have the real run's shape, dtype and strides, and the
fake run must launch no Triton kernel (every launch goes through ``JITFunction.run`` or, under the interpreter,
``InterpretedFunction.run``, both counted here).

Also checked: every ``torch.autograd.Function`` of the package names the custom ops its kernels run through
(``kernel_ops``, empty for torch-only Functions), each of them has a fake implementation, and every
``liger_dspine::`` custom op is exercised by a case below.
"""

import importlib
import pkgutil

import pytest
import torch
import triton
from torch._library.custom_ops import OPDEFS
from torch._subclasses.fake_tensor import FakeTensorMode
from triton.runtime import interpreter

import liger_dspine
from liger_dspine.modules import backward_guard
from liger_dspine.modules import label_checks
from liger_dspine.ops import alignment_cosine
from liger_dspine.ops import candidate_scores
from liger_dspine.ops import embedding
from liger_dspine.ops import fp8_grouped_mm
from liger_dspine.ops import fp8_linear
from liger_dspine.ops import fp8_quantize
from liger_dspine.ops import frozen_head_loss
from liger_dspine.ops import frozen_head_objective
from liger_dspine.ops import grouped_experts
from liger_dspine.ops import hash_router
from liger_dspine.ops import indexer_scores
from liger_dspine.ops import interleaved_rope
from liger_dspine.ops import liger_kernel_ops
from liger_dspine.ops import linear_cross_entropy
from liger_dspine.ops import masked_attention
from liger_dspine.ops import mhc_coefficients
from liger_dspine.ops import mhc_projection
from liger_dspine.ops import mhc_streams
from liger_dspine.ops import moe_router
from liger_dspine.ops import refinement_loss
from liger_dspine.ops import scaled_write
from liger_dspine.ops import silu_mul_rows
from liger_dspine.ops import sink_attention
from liger_dspine.ops import slot_sum
from liger_dspine.ops import swiglu_down
from liger_dspine.ops import trailing_rope
from liger_dspine.ops.eager_dispatch import REGISTERED_OPS

NAMESPACE = "liger_dspine::"
# Functions whose backward cannot run on fake tensors; they never reach a compiled graph (see their docstrings).
EAGER_ONLY = {backward_guard._NoteScaledFunction, backward_guard._RefuseAfterScaledFunction}


def randn(*shape, dtype=torch.float32, grad=False):
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)


def randint(high, *shape):
    return torch.randint(0, high, shape)


def rope_angles(seq):
    return randn(1, seq, 4), randn(1, seq, 4)


# Each case: the ops it covers, and a function returning (outputs, inputs to differentiate).
def case_rope():
    x = randn(1, 3, 2, 6, grad=True)
    cos, sin = rope_angles(3)
    return interleaved_rope.LigerInterleavedRopeFunction.apply(x.transpose(1, 2)[..., 2:], cos, sin), [x]


def case_mla_query_in_place():
    q = randn(1, 3, 2, 6, grad=True)  # [B, S, H, D]: the gradient of the position-major query has q's layout
    cos, sin = rope_angles(3)
    return interleaved_rope.LigerMLAQueryFunction.apply(q.transpose(1, 2), cos, sin, 4), [q]


def case_mla_query():
    q = randn(1, 2, 3, 6, grad=True)  # [B, H, S, D] contiguous: another layout than the query's
    cos, sin = rope_angles(3)
    return interleaved_rope.LigerMLAQueryFunction.apply(q, cos, sin, 4), [q]


def case_mla_key():
    kv, k_rot = randn(1, 3, 2, 5, grad=True), randn(1, 3, 4, grad=True)
    cos, sin = rope_angles(3)
    out = interleaved_rope.LigerMLAKeyFunction.apply(kv.transpose(1, 2), k_rot[:, None], cos, sin, 2)
    return out, [kv, k_rot]


def case_mla_key_cached():
    kv, k_rot = randn(1, 2, 3, 5, grad=True), randn(1, 1, 3, 4, grad=True)
    return interleaved_rope.LigerMLAKeyFunction.apply(kv, k_rot, None, None, 2), [kv, k_rot]


def case_moe_router():
    logits = randn(5, 8, grad=True)
    out = moe_router.LigerMoeRouterFunction.apply(logits, randn(8), 3, 4, 2, True, 2.5)
    return out, [logits]


def case_moe_router_softmax():
    logits = randn(5, 6, grad=True)  # softmax, group-max selection, no correction bias (DeepSeek-V2)
    out = moe_router.LigerMoeRouterFunction.apply(logits, None, 2, 3, 2, False, 1.5, "softmax", "max")
    return out, [logits]


def case_moe_router_sqrtsoftplus():
    logits = randn(5, 6, grad=True)  # sqrtsoftplus, one group, correction bias (DeepSeek-V4)
    out = moe_router.LigerMoeRouterFunction.apply(logits, randn(6), 2, 1, 1, True, 1.5, "sqrtsoftplus", "max")
    return out, [logits]


def case_hash_router():
    logits = randn(5, 6, grad=True)
    out = hash_router.LigerHashRouterFunction.apply(logits, randint(6, 5, 2), "sqrtsoftplus", 1.5)
    return out, [logits]


def case_mla_key_pairs():
    kv, k_rot = randn(1, 3, 2, 5, grad=True), randn(1, 3, 4, grad=True)  # DeepSeek-V2's in-place pair RoPE
    cos, sin = rope_angles(3)
    out = interleaved_rope.LigerMLAKeyFunction.apply(kv.transpose(1, 2), k_rot[:, None], cos, sin, 2, "pairs")
    return out, [kv, k_rot]


def case_mla_query_halves():
    q = randn(1, 3, 2, 6, grad=True)  # half-split RoPE (MiniCPM3)
    cos, sin = rope_angles(3)
    return interleaved_rope.LigerMLAQueryFunction.apply(q.transpose(1, 2), cos, sin, 4, "halves"), [q]


def case_router_logits():
    hidden, weight = randn(5, 6, grad=True), randn(8, 6, grad=True)
    return moe_router.LigerRouterLogitsFunction.apply(hidden, weight), [hidden, weight]


def case_grouped_experts():
    hidden, weights = randn(4, 8, grad=True), randn(4, 2, grad=True)
    gate_up, down = randn(3, 12, 8, grad=True), randn(3, 8, 6, grad=True)
    out = grouped_experts.LigerGroupedExpertsFunction.apply(hidden, randint(3, 4, 2), weights, gate_up, down)
    return out, [hidden, weights, gate_up, down]


def case_silu_mul_rows():
    gate_up, g, w = randn(5, 12), randn(5, 6), randn(5)
    act = silu_mul_rows.silu_mul_rows(gate_up)
    fresh = silu_mul_rows.silu_mul_rows_backward(gate_up, g, w, row_dot=True, scaled_act=True, in_place=False)
    _, dots, scaled = silu_mul_rows.silu_mul_rows_backward(gate_up, g, w, row_dot=True, scaled_act=False, in_place=True)
    return (act, *fresh, dots, gate_up), []


def case_clamped_silu_mul_rows():
    gate_up, g, w = 3 * randn(5, 12), randn(5, 6), randn(5)
    act = silu_mul_rows.silu_mul_rows(gate_up, 1.5)
    fresh = silu_mul_rows.silu_mul_rows_backward(
        gate_up, g, w, row_dot=True, scaled_act=True, in_place=False, limit=1.5
    )
    _, _, scaled = silu_mul_rows.silu_mul_rows_backward(
        gate_up, g, w, row_dot=False, scaled_act=True, in_place=True, limit=1.5
    )
    return (act, *fresh, scaled, gate_up), []


def case_clamped_grouped_experts():
    hidden, weights = randn(4, 8, grad=True), randn(4, 2, grad=True)
    gate_up, down = randn(3, 12, 8, grad=True), randn(3, 8, 6, grad=True)
    out = grouped_experts.liger_grouped_experts(hidden, randint(3, 4, 2), weights, gate_up, down, limit=1.5)
    return out, [hidden, weights, gate_up, down]


def case_slot_sum():
    return slot_sum.slot_sum(randn(6, 5), randint(6, 3, 2), randn(3, 2), torch.float16), []


def case_swiglu_down():
    gate, up, weight = randn(2, 3, 6, grad=True), randn(2, 3, 6, grad=True), randn(8, 6, grad=True)
    return swiglu_down.LigerSwiGLUDownFunction.apply(gate * 1, up * 1, weight, True), [gate, up, weight]


def case_silu_mul():
    gate, up = randn(4, 6), randn(4, 6)
    product = liger_kernel_ops.silu_mul(gate, up)
    liger_kernel_ops.silu_mul_backward_(gate, up, randn(4, 6))
    return (product, gate, up), []


def case_rms_norm():
    x, weight = randn(2, 3, 8, grad=True), randn(8, grad=True)
    return liger_kernel_ops.LigerRMSNormFunction.apply(x, weight, 1e-6, 0.0, "llama"), [x, weight]


def case_fused_linear_cross_entropy():
    hidden, weight = randn(6, 8, grad=True), randn(16, 8, grad=True)
    targets = torch.tensor([1, 2, -100, 3, 4, 15])
    out = liger_kernel_ops.LigerFusedLinearCrossEntropyOpFunction.apply(hidden, weight, targets, -100, 1)
    return out, [hidden, weight]


def case_vocab_chunked_cross_entropy():
    hidden, weight = randn(6, 8, grad=True), randn(20, 8, grad=True)
    targets = torch.tensor([1, 2, -100, 3, 4, 19])
    Function = linear_cross_entropy.LigerVocabChunkedLinearCrossEntropyFunction
    return Function.apply(hidden, weight, targets, -100, "mean", True, 8), [hidden, weight]


def case_checked_labels():
    return label_checks._checked_labels_op(randint(16, 2, 5), 16, -100, False), []


def case_label_check_in_two_ops():
    labels = randint(16, 2, 5)
    bounds = label_checks._label_bounds_to_host_op(labels, -100, False)
    return label_checks._finish_label_check_op(labels, bounds, randn(2, 3), 16, -100, False), []


def frozen_head_inputs():
    draft, head = randn(5, 8, grad=True), randn(32, 8)
    return draft, head, randint(32, 5), randn(5, 8)


def case_frozen_head_loss():
    draft, head, labels, teacher = frozen_head_inputs()
    Function = frozen_head_loss.LigerFrozenHeadLossFunction
    with_teacher = Function.apply(draft, head, labels, teacher, randn(5), randn(5), 3, 2, torch.float32, True)
    ce_only = Function.apply(draft, head, labels, None, randn(5), None, 0, 4, torch.float32, True)
    return (*with_teacher, *ce_only), [draft]


def case_frozen_head_terms():
    draft, head, labels, teacher = frozen_head_inputs()
    Function = frozen_head_objective.LigerFrozenHeadTermsFunction
    with_teacher = Function.apply(draft, head, labels, teacher, 3, 2, torch.float32)
    ce_only = Function.apply(draft, head, labels, None, 0, 4, torch.float32)
    return (*with_teacher, *ce_only), [draft]


def case_candidate_scores():
    hidden = randn(4, 8, grad=True)
    return candidate_scores.LigerCandidateScoresFunction.apply(hidden, randn(32, 8), randint(32, 4, 3)), [hidden]


def case_alignment_cosine():
    features = randn(2, 3, 4, 8, grad=True)
    return alignment_cosine.LigerAlignmentCosineFunction.apply(features, randn(2, 4, 8), 1e-8), [features]


def case_refinement_loss():
    hidden, ids = randn(4, 8, grad=True), randint(32, 4, 3)
    probs, labels = torch.rand(4, 3), ids[:, 0].clone()
    Function = refinement_loss.LigerRefinementLossFunction
    return Function.apply(hidden, randn(32, 8), ids, probs, labels, 0.3, 0.1), [hidden]


def case_scaled_write():
    states, message, weight, projected = randn(4, 8, grad=True), randn(4, 3, grad=True), randn(8, 3), randn(4, 5)
    projected.requires_grad_()
    written = scaled_write.LigerScaledWriteFunction.apply(states, message, weight)
    feature = scaled_write.LigerUnitFeatureFunction.apply(projected, 2.0, 1e-12)
    return (written, feature), [states, message, projected]


def case_sink_attention():
    q, kv, sinks = randn(2, 3, 20, 16, grad=True), randn(2, 25, 16, grad=True), randn(3, grad=True)
    mask, bias = randn(1, 1, 20, 25), torch.zeros(2, 1, 20, 5)
    out = sink_attention.liger_sink_attention(q, kv, sinks, 4, 0.25, mask=mask, bias=bias)
    return out, [q, kv, sinks]


def case_masked_attention():
    q = randn(2, 20, 4, 16).transpose(1, 2).requires_grad_(True)
    k, v = randn(2, 2, 25, 16, grad=True), randn(2, 2, 25, 16, grad=True)
    mask = torch.randn(1, 1, 20, 25) > 0
    return masked_attention.liger_masked_attention(q, k, v, mask, 0.25), [q, k, v]


def case_trailing_rope():
    x = randn(2, 3, 4, 16, grad=True)
    cos, sin = randn(1, 3, 4), randn(1, 3, 4)
    normed = trailing_rope.liger_trailing_rope(x, cos, sin, eps=1e-6)
    return (normed, trailing_rope.liger_trailing_rope(x, cos, sin)), [x]


def case_mhc_projection():
    x, fn = randn(9, 40, grad=True), randn(24, 40, grad=True)
    return mhc_projection.liger_mhc_projection(x, fn, 1e-6), [x, fn]


def case_mhc_coefficients():
    streams, fn = randn(2, 3, 4, 8, grad=True), randn(24, 32, grad=True)
    base, scale = randn(24, grad=True), randn(3, grad=True)
    return mhc_coefficients.liger_mhc_coefficients(streams, fn, base, scale, 5, 1e-6, 1e-6, 1e-6), [fn, base, scale]


def case_indexer_scores():
    q, k, weights = randn(2, 9, 3, 16), randn(2, 11, 16), randn(2, 9, 3)
    return indexer_scores.liger_indexer_scores(q, k, weights, 0.25), []


def case_mhc_streams():
    streams, f = randn(2, 3, 4, 40, grad=True), randn(2, 3, 40, grad=True)
    pre, post, comb = randn(2, 3, 4, grad=True), randn(2, 3, 4, grad=True), randn(2, 3, 4, 4, grad=True)
    collapsed = mhc_streams.liger_mhc_collapse(streams, pre)
    return (collapsed, mhc_streams.liger_mhc_mix(streams, f, post, comb)), [streams, f, pre, post, comb]


def case_fp8_quantize():
    x, w, offs = randn(5, 24), randn(2, 7, 16), torch.tensor([2, 2, 5], dtype=torch.int32)
    rows = fp8_quantize.quantize_rowwise(x)
    return (*rows, *fp8_quantize.quantize_columns(w), *fp8_quantize.quantize_group_columns(x, offs)), []


def case_fp8_linear():
    x, weight = randn(5, 32, grad=True), randn(16, 32, grad=True)
    return fp8_linear.LigerFP8LinearFunction.apply(x, weight), [x, weight]


def case_fp8_grouped_mm():
    x, weight, offs = randn(5, 16, grad=True), randn(3, 32, 16, grad=True), torch.tensor([2, 2, 5], dtype=torch.int32)
    return fp8_grouped_mm.LigerFP8GroupedMMFunction.apply(x, weight, offs), [x, weight]


def case_embedding():
    ids, weight = torch.tensor([[3, 0, 3], [5, 1, 2]]), randn(7, 16, grad=True)
    return embedding.liger_embedding(ids, weight, padding_idx=1), [weight]


CASES = {
    case_embedding: ("embedding_weight_grad",),
    case_rope: ("rope_rotate",),
    case_mla_query_in_place: ("rope_rotate", "rope_unrotate_"),
    case_mla_query: ("rope_rotate",),
    case_mla_key: ("mla_key", "mla_key_backward"),
    case_mla_key_cached: ("mla_key", "mla_key_backward"),
    case_moe_router: ("moe_router_select", "moe_router_select_backward"),
    case_moe_router_softmax: ("moe_router_select", "moe_router_select_backward"),
    case_moe_router_sqrtsoftplus: ("moe_router_select", "moe_router_select_backward"),
    case_hash_router: ("moe_router_select_backward",),
    case_mla_key_pairs: ("mla_key", "mla_key_backward"),
    case_mla_query_halves: ("rope_rotate", "rope_unrotate_"),
    case_router_logits: ("router_logits_weight_grad",),
    case_grouped_experts: ("grouped_experts", "grouped_experts_backward_"),
    case_silu_mul_rows: ("silu_mul_rows", "silu_mul_rows_backward", "silu_mul_rows_backward_"),
    case_clamped_silu_mul_rows: ("silu_mul_rows", "silu_mul_rows_backward", "silu_mul_rows_backward_"),
    case_clamped_grouped_experts: ("grouped_experts", "grouped_experts_backward_"),
    case_slot_sum: ("slot_sum",),
    case_swiglu_down: ("silu_mul", "silu_mul_backward_", "swiglu_down_weight_grad"),
    case_silu_mul: ("silu_mul", "silu_mul_backward_"),
    case_rms_norm: ("rms_norm", "rms_norm_backward"),
    case_fused_linear_cross_entropy: ("fused_linear_cross_entropy",),
    case_vocab_chunked_cross_entropy: ("vocab_chunked_ce_stats", "vocab_chunked_ce_backward"),
    case_checked_labels: ("checked_labels",),
    case_label_check_in_two_ops: ("label_bounds_to_host", "finish_label_check"),
    case_frozen_head_loss: ("frozen_head_loss",),
    case_frozen_head_terms: ("frozen_head_terms", "frozen_head_terms_backward"),
    case_candidate_scores: ("candidate_scores", "candidate_scores_backward"),
    case_refinement_loss: ("refinement_loss", "candidate_scores", "candidate_scores_backward"),
    case_alignment_cosine: ("alignment_cosine", "alignment_cosine_backward"),
    case_scaled_write: ("scaled_write", "scaled_write_backward", "unit_feature", "unit_feature_backward"),
    case_sink_attention: ("sink_attention", "sink_attention_backward"),
    case_masked_attention: ("masked_attention", "masked_attention_backward"),
    case_trailing_rope: ("trailing_rope", "trailing_rope_backward"),
    case_mhc_projection: ("mhc_projection", "mhc_projection_backward"),
    case_mhc_coefficients: ("mhc_projection", "mhc_projection_backward", "mhc_sinkhorn", "mhc_sinkhorn_backward"),
    case_mhc_streams: ("mhc_collapse", "mhc_collapse_backward", "mhc_mix", "mhc_mix_backward"),
    case_indexer_scores: ("indexer_scores",),
    case_fp8_quantize: ("fp8_quantize_rows", "fp8_quantize_columns", "fp8_quantize_group_columns"),
    case_fp8_linear: ("fp8_quantize_rows", "fp8_quantize_columns", "fp8_scaled_mm"),
    case_fp8_grouped_mm: (
        "fp8_quantize_rows",
        "fp8_quantize_columns",
        "fp8_quantize_group_columns",
        "fp8_grouped_mm",
        "fp8_grouped_mm_weight_grad",
    ),
}


@pytest.fixture
def launches(monkeypatch):
    """The number of Triton kernel launches since the fixture was set up."""
    count = [0]

    def counting(run):
        def counted(*args, **kwargs):
            count[0] += 1
            return run(*args, **kwargs)

        return counted

    monkeypatch.setattr(triton.runtime.jit.JITFunction, "run", counting(triton.runtime.jit.JITFunction.run))
    monkeypatch.setattr(interpreter.InterpretedFunction, "run", counting(interpreter.InterpretedFunction.run))
    return count


def tensors(outputs) -> list[torch.Tensor]:
    outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    return [t for t in outputs if isinstance(t, torch.Tensor)]


def run_case(case, seed=0):
    """(outputs, input gradients) of ``case`` for ones as the gradients of its differentiable outputs."""
    torch.manual_seed(seed)
    outputs, inputs = case()
    outputs = tensors(outputs)
    differentiable = [t for t in outputs if t.requires_grad]
    grads = []
    if inputs and differentiable:
        ones = [torch.ones_like(t) for t in differentiable]
        grads = torch.autograd.grad(differentiable, inputs, ones, allow_unused=True)
    return outputs, [g for g in grads if g is not None]


def layout(t: torch.Tensor):
    return tuple(t.shape), t.dtype, t.stride() if t.numel() else None


@pytest.mark.parametrize("case", list(CASES), ids=lambda case: case.__name__[len("case_") :])
def test_fake_run_gives_the_real_layouts_without_a_kernel(case, launches):
    real_outputs, real_grads = run_case(case)
    real_launches = launches[0]
    with FakeTensorMode():
        fake_outputs, fake_grads = run_case(case)
    assert launches[0] == real_launches, "a kernel was launched under FakeTensorMode"
    torch_ops_only = (case_checked_labels, case_label_check_in_two_ops, case_embedding, case_router_logits)
    if CASES[case] and case not in torch_ops_only:
        assert real_launches > 0  # the counter sees this case's kernels
    assert [layout(t) for t in fake_outputs] == [layout(t) for t in real_outputs]
    assert [layout(g) for g in fake_grads] == [layout(g) for g in real_grads]
    assert len(real_grads) == sum(t.requires_grad for t in case()[1])  # every input got a gradient
    assert not any(t._is_view() for t in real_outputs if t.grad_fn is not None)


def has_fake(name: str) -> bool:
    if name in REGISTERED_OPS:
        return REGISTERED_OPS[name].fake_impl is not None
    return OPDEFS[name]._abstract_fn is not None


def package_functions() -> list[type]:
    for info in pkgutil.walk_packages(liger_dspine.__path__, "liger_dspine."):
        if not info.name.startswith(("liger_dspine.cli", "liger_dspine.demo")):
            importlib.import_module(info.name)
    found, stack = [], [torch.autograd.Function]
    while stack:
        for cls in stack.pop().__subclasses__():
            stack.append(cls)
            if cls.__module__.startswith("liger_dspine.") and "forward" in vars(cls):
                found.append(cls)
    return found


def test_every_autograd_function_names_kernel_ops_with_fake_implementations():
    functions = package_functions()
    assert len(functions) >= 15
    for cls in functions:
        assert hasattr(cls, "kernel_ops"), (
            f"{cls.__module__}.{cls.__qualname__} does not name its kernel ops: run its kernels through "
            "torch.library custom ops with register_fake and list them in kernel_ops (() for torch ops only)"
        )
        for name in cls.kernel_ops:
            assert name in REGISTERED_OPS or name in OPDEFS, f"{cls.__qualname__}: {name} is not a custom op"
            assert has_fake(name), f"{name} has no fake implementation"


def test_every_autograd_function_refuses_a_graph_building_backward():
    """Their backwards compute from what the forward kept, so second-order terms through them would be missing."""
    functions = package_functions()
    with_backward = {c for f in functions for c in (f, *f.__subclasses__()) if "backward" in vars(c)}
    assert len(with_backward) >= 25
    for cls in with_backward:
        assert getattr(cls.backward, "first_order_only", False), (
            f"{cls.__module__}.{cls.__qualname__}.backward is not wrapped in ops.first_order.first_order_only"
        )


def test_every_custom_op_has_a_fake_implementation_and_a_fake_test():
    package_functions()
    ops = {name for name in (*REGISTERED_OPS, *OPDEFS) if name.startswith(NAMESPACE)}
    assert ops, "no liger_dspine custom op registered"
    assert all(has_fake(name) for name in ops)
    tested = {NAMESPACE + name for names in CASES.values() for name in names}
    assert ops == tested
    assert tested <= ops
