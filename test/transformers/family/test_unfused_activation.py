"""MLPs and experts whose activation the SwiGLU kernels do not fuse (``hidden_act="gelu"``, as in transformers' own
tiny test configs) stay native, and the rest of the patch applies.

Class level: the model builds, its MLPs and experts are transformers' own modules (native ``__init__``, forward and
methods) under a class derived from the Liger one too, and the logits, the loss and every gradient equal the native
model's; a warning names the kept classes. Instance level: the report lists each kept module by path and reason.
fp32 on the CPU interpreter: the other swaps (norms, attention, router, loss) sum in another order, hence 1e-5.
"""

import copy
import logging
import pickle
import sys
from pathlib import Path

import pytest
import torch
import transformers
from packaging.version import Version

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from liger_dspine import patching  # noqa: E402
from liger_dspine.modules.grouped_experts import LigerGroupedExperts  # noqa: E402
from liger_dspine.modules.rms_norm import LigerRMSNorm  # noqa: E402
from liger_dspine.modules.swiglu import LigerSwiGLUMLP  # noqa: E402
from tiny_family import CASES  # noqa: E402

# Verified on transformers 5.24 and 5.25; the older versions' routers, MoE blocks and outputs differ (to be covered).
NEWER_TRANSFORMERS = pytest.mark.skipif(
    Version(transformers.__version__) < Version("5.24"), reason="checked on transformers >= 5.24 only"
)
pytestmark = [pytest.mark.matrix, NEWER_TRANSFORMERS]

MODEL_TYPES = ["deepseek_v2", "glm4_moe_lite", "deepseek_v4"]
TOLERANCE = dict(rtol=1e-5, atol=1e-5)
# DeepSeek-V4's hyper-connection kernels: fp32 rounding through its Sinkhorn head reaches about 1e-3 even natively
# (tiny_family.py, fp64_reference); they are off here, since only the MLPs and experts are under test.
OPTIONS = {"deepseek_v4": dict(hyper_connections=False)}


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Each kept class warns once per process: start from none warned."""
    monkeypatch.setattr(patching, "_WARNED_KEPT_NATIVE", set())


@pytest.fixture(params=MODEL_TYPES)
def case(request):
    case = CASES[request.param]
    case.modeling_or_skip()
    return case


def gelu_model(case):
    return case.build(hidden_act="gelu")


def apply(case, **kwargs):
    return case.apply_fn()(**OPTIONS.get(case.model_type, {}), **kwargs)


def native_class(case, kind: str) -> type:
    """``<prefix>MLP`` or ``<prefix>Experts`` as transformers defines it."""
    modeling = case.modeling_or_skip()
    return patching.original_global(modeling.__name__, f"{case.prefix}{kind}")


def swiglu_modules(model, case) -> dict[str, torch.nn.Module]:
    kinds = (native_class(case, "MLP"), native_class(case, "Experts"), LigerSwiGLUMLP, LigerGroupedExperts)
    return {name: m for name, m in model.named_modules() if isinstance(m, kinds)}


def loss_logits_grads(model, input_ids, **kwargs):
    model.train()
    model.zero_grad(set_to_none=True)
    output = model(input_ids=input_ids, labels=input_ids, **kwargs)
    output.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return output.loss.detach(), output.logits.detach(), grads


def batch(case):
    return torch.randint(0, case.vocab_size, (2, 8), generator=torch.Generator().manual_seed(5))


def assert_same_numbers(patched, reference, case):
    """``reference``: the native model's loss, logits and gradients, computed before any class-level patch (that
    patch changes the causal LM's forward of every instance)."""
    loss, logits, grads = loss_logits_grads(patched, batch(case), skip_logits=False)  # the logits too
    ref_loss, ref_logits, ref_grads = reference
    torch.testing.assert_close(loss, ref_loss, **TOLERANCE)
    torch.testing.assert_close(logits, ref_logits, **TOLERANCE)
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, **TOLERANCE, msg=lambda m: f"{name}: {m}")


@pytest.fixture
def class_level(case):
    yield
    case.revert_fn()()


def test_class_patch_builds_native_mlps_and_experts_and_computes_native_numbers(case, class_level, caplog):
    native = gelu_model(case)
    reference = loss_logits_grads(native, batch(case))
    apply(case)
    with caplog.at_level(logging.WARNING, logger="liger_dspine"):
        patched = gelu_model(case)
    patched.load_state_dict(native.state_dict())

    kept = swiglu_modules(patched, case)
    assert kept, "the model has MLPs and experts"
    for name, module in kept.items():
        native_type = type(swiglu_modules(native, case)[name])
        assert isinstance(module, native_type) and type(module).forward is native_type.forward, name
        assert type(module).__name__ == native_type.__name__
    assert any(isinstance(m, LigerRMSNorm) for m in patched.modules()), "the other swaps apply"
    warned = [r.getMessage() for r in caplog.records if "stays native" in r.getMessage()]
    for kind, liger in (("MLP", LigerSwiGLUMLP), ("Experts", LigerGroupedExperts)):
        expected = f"liger-dspine: {case.prefix}{kind} (for {liger.__name__}) stays native"
        assert sum(message.startswith(expected) for message in warned) == 1, warned
    assert all("config.hidden_act is 'gelu', and the kernel fuses SiLU only" in message for message in warned)

    assert_same_numbers(patched, reference, case)


def test_kept_modules_copy_and_pickle_as_native(case, class_level):
    apply(case)
    model = gelu_model(case)
    module = next(m for m in model.modules() if isinstance(m, native_class(case, "MLP")))
    x = torch.randn(3, module.hidden_size, generator=torch.Generator().manual_seed(0))
    for again in (copy.deepcopy(module), pickle.loads(pickle.dumps(module))):
        assert type(again) is type(module)
        torch.testing.assert_close(again(x), module(x), rtol=0, atol=0)


def test_instance_patch_keeps_them_native_and_reports_them(case, caplog):
    native = gelu_model(case)
    patched = copy.deepcopy(native)
    reference = loss_logits_grads(native, batch(case))
    before = {name: type(m) for name, m in swiglu_modules(patched, case).items()}

    with caplog.at_level(logging.WARNING, logger="liger_dspine"):
        report = apply(case, model=patched)

    assert {name: type(m) for name, m in swiglu_modules(patched, case).items()} == before
    assert {k.path for k in report.kept_native} == set(before)
    assert {(k.native, k.replacement) for k in report.kept_native} == {
        (f"{case.prefix}MLP", "LigerSwiGLUMLP"),
        (f"{case.prefix}Experts", "LigerGroupedExperts"),
    }
    assert all(k.reason == "config.hidden_act is 'gelu', and the kernel fuses SiLU only" for k in report.kept_native)
    assert f"kept native: {sorted(before)[0]} (" in str(report)
    assert any(r.target.endswith("RMSNorm modules") for r in report), "the other swaps apply"
    assert sum("stays native" in r.getMessage() for r in caplog.records) == 2  # once per class and reason

    again = apply(case, model=patched)  # applying again reports them again
    assert {k.path for k in again.kept_native} == set(before)
    assert_same_numbers(patched, reference, case)
