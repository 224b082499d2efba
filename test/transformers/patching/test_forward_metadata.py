"""A forward installed by a class-level patch carries the native forward's annotations, signature and docstring:
transformers reads them (its output-recording tests read the causal LM forward's return annotation to know which
outputs it declares, generation reads its parameters).

For every registered model type with a causal-LM loss forward: after the class-level patch, ``typing.get_type_hints``
and ``inspect.signature(...).return_annotation`` of ``<CausalLM>.forward`` equal the native ones, every native
parameter is there (the forward's own keyword options after them), and the docstring is the native one. A
``Liger<Native>`` module class's forward is dressed likewise. On a tiny MoE model, ``output_router_logits=True``
returns the router logits as natively.
"""

import importlib
import inspect
import sys
import typing
from pathlib import Path

import pytest
import torch
import transformers
from packaging.version import Version

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import liger_dspine  # noqa: E402
from liger_dspine import patching  # noqa: E402
from liger_dspine.registry import MODEL_TYPE_TO_APPLY_LIGER_FN  # noqa: E402

# Verified on transformers 5.24 and 5.25; the older versions' routers, MoE blocks and outputs differ (to be covered).
NEWER_TRANSFORMERS = pytest.mark.skipif(
    Version(transformers.__version__) < Version("5.24"), reason="checked on transformers >= 5.24 only"
)
pytestmark = [pytest.mark.matrix, NEWER_TRANSFORMERS]


def spec_of(model_type: str) -> patching.PatchSpec:
    """The spec the model type's apply function applies (another model type's, for an alias such as sarvam_mla)."""
    module = sys.modules[MODEL_TYPE_TO_APPLY_LIGER_FN[model_type].__module__]
    (spec,) = {id(v): v for v in vars(module).values() if isinstance(v, patching.PatchSpec)}.values()
    return spec


def forward_swaps(spec) -> list[patching.MethodSwap]:
    return [s for s in spec.swaps if isinstance(s, patching.MethodSwap) and s.method == "forward"]


def owner_or_skip(spec, swap) -> type:
    try:
        modeling = importlib.import_module(swap.module or spec.module)
    except ModuleNotFoundError:
        pytest.skip(f"this transformers has no {spec.model_type}")
    return getattr(modeling, swap.owner)


def loss_options(apply) -> dict:
    """The apply options that put a loss forward in place: the defaults, or Liger's cross entropy where no loss
    forward is on by default."""
    params = inspect.signature(apply).parameters
    if params.get("fused_linear_cross_entropy") is not None and params["fused_linear_cross_entropy"].default:
        return {}
    options = {"cross_entropy": True}
    if "fused_linear_cross_entropy" in params:
        options["fused_linear_cross_entropy"] = False
    return options


# each spec once (an alias applies another model type's spec)
LOSS_MODEL_TYPES = sorted({spec_of(mt).model_type for mt in MODEL_TYPE_TO_APPLY_LIGER_FN if forward_swaps(spec_of(mt))})


def test_every_model_type_with_a_causal_lm_is_covered():
    assert {"deepseek_v3", "deepseek_v2", "deepseek_v4", "glm4_moe_lite", "youtu", "kimi_k25"} <= set(LOSS_MODEL_TYPES)


@pytest.mark.parametrize("model_type", LOSS_MODEL_TYPES)
def test_class_patched_loss_forward_carries_the_native_metadata(model_type):
    spec = spec_of(model_type)
    swap = forward_swaps(spec)[0]
    owner = owner_or_skip(spec, swap)
    native = owner.forward
    hints, signature, doc = typing.get_type_hints(native), inspect.signature(native), native.__doc__
    apply = MODEL_TYPE_TO_APPLY_LIGER_FN[model_type]
    try:
        apply(**loss_options(apply))
        patched = owner.forward
        assert patched is not native and patching.replacement_of(patched).__module__.startswith("liger_dspine.")
        assert typing.get_type_hints(patched) == hints
        assert inspect.signature(patched).return_annotation == signature.return_annotation
        assert patched.__annotations__["return"] is native.__annotations__["return"]
        assert patched.__doc__ == doc
        params = inspect.signature(patched).parameters
        for name, param in signature.parameters.items():
            assert params[name] == param, name
        own = [p for name, p in params.items() if name not in signature.parameters]
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in own), own
    finally:
        getattr(liger_dspine, f"revert_liger_kernel_to_{model_type}")()
    assert owner.forward is native


def test_the_same_bound_forward_on_applying_again():
    from transformers import DeepseekV3ForCausalLM

    from liger_dspine import apply_liger_kernel_to_deepseek_v3
    from liger_dspine import revert_liger_kernel_to_deepseek_v3

    try:
        apply_liger_kernel_to_deepseek_v3()
        first = DeepseekV3ForCausalLM.forward
        report = apply_liger_kernel_to_deepseek_v3()
        assert DeepseekV3ForCausalLM.forward is first and all(r.already for r in report)
    finally:
        revert_liger_kernel_to_deepseek_v3()


def test_liger_module_class_forward_carries_the_native_metadata():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from liger_dspine import apply_liger_kernel_to_deepseek_v3
    from liger_dspine import revert_liger_kernel_to_deepseek_v3
    from liger_dspine.models.deepseek_v3.router import LigerDeepseekV3TopkRouter
    from liger_dspine.models.deepseek_v3.router import LigerTopkRouter

    try:
        apply_liger_kernel_to_deepseek_v3()
        forward = LigerDeepseekV3TopkRouter.forward
        assert patching.replacement_of(forward) is LigerTopkRouter.forward
        assert inspect.signature(forward) == inspect.signature(DeepseekV3TopkRouter.forward)
        assert forward.__doc__ == DeepseekV3TopkRouter.forward.__doc__
    finally:
        revert_liger_kernel_to_deepseek_v3()


def test_output_router_logits_are_returned_as_natively():
    """What transformers' ``test_moe_models_record_router_logits`` checks, then the logits themselves."""
    from transformers import DeepseekV3ForCausalLM

    from liger_dspine import apply_liger_kernel_to_deepseek_v3
    from liger_dspine import revert_liger_kernel_to_deepseek_v3
    from tiny_models import build_model
    from tiny_models import tiny_deepseek_v3_config

    config = tiny_deepseek_v3_config()
    input_ids = torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    native = build_model(config).eval()
    with torch.no_grad():
        expected = native(input_ids=input_ids, output_router_logits=True).router_logits
    assert len(expected) == 1  # one MoE layer

    try:
        apply_liger_kernel_to_deepseek_v3()
        return_type = DeepseekV3ForCausalLM.forward.__annotations__.get("return")
        fields = set().union(
            *(getattr(t, "__dataclass_fields__", {}).keys() for t in (typing.get_args(return_type) or (return_type,)))
        )
        assert "router_logits" in fields
        patched = build_model(config).eval()
        patched.load_state_dict(native.state_dict())
        with torch.no_grad():
            output = patched(input_ids=input_ids, output_router_logits=True)
            assert not patched(input_ids=input_ids).router_logits
    finally:
        revert_liger_kernel_to_deepseek_v3()
    assert len(output.router_logits) == len(expected)
    for ours, ref in zip(output.router_logits, expected):
        torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
