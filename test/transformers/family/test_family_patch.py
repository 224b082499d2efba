"""The patches of the models built from DeepSeek-V3's classes: what each replaces, native against patched training
at instance and class level, applying again, revert, state-dict keys. One tiny model per type (tiny_family.py)."""

import copy
import importlib
import inspect
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from liger_dspine import patching  # noqa: E402
from liger_dspine.models.deepseek_v3.family import swapped_class_names  # noqa: E402
from liger_dspine.modules.grouped_experts import LigerGroupedExperts  # noqa: E402
from liger_dspine.modules.rms_norm import LigerRMSNorm  # noqa: E402
from liger_dspine.modules.swiglu import LigerSwiGLUMLP  # noqa: E402
from liger_dspine.registry import MODEL_TYPE_TO_APPLY_LIGER_FN  # noqa: E402
from tiny_family import CASES  # noqa: E402
from tiny_family import own_no_split_lists  # noqa: E402

pytestmark = pytest.mark.matrix  # runs against every transformers version of the matrix that has the model

STEPS = 2  # the second step runs on weights the optimizer changed in place
# a case held to an fp64 run (fp64_reference) takes native fp32's worst distance over more steps as its scale
FP64_REFERENCE_STEPS = 3
# fp32 on both sides; the kernels sum in another order (1e-6 level per op), and the SGD step carries it along.
RTOL = 1e-5


def spec_of(case):
    return sys.modules[MODEL_TYPE_TO_APPLY_LIGER_FN[case.model_type].__module__].__dict__[
        f"{case.model_type.upper()}_SPEC"
    ]


def liger_type(case, native_name: str) -> type:
    """The class a native class of ``case`` becomes with the default options: the model's own ``Liger<native>``
    where it has one (DeepSeek-V4's norm), else the shared module of its kind."""
    modules = [importlib.import_module(name) for name in case.liger_module_names]
    own = [getattr(m, f"Liger{native_name}") for m in modules if hasattr(m, f"Liger{native_name}")]
    if own:
        (found,) = own
        return found
    if native_name.endswith("RMSNorm"):
        return LigerRMSNorm
    if native_name.endswith("MLP"):
        return LigerSwiGLUMLP
    if native_name.endswith(("Experts", "NaiveMoe")):
        return LigerGroupedExperts
    raise AssertionError(f"no Liger class for {native_name}")


def experts_alias(native_name: str) -> str:
    """The name the case lists a native class under: the experts class is ``<prefix>NaiveMoe`` before transformers
    5.9 (the spec names it second)."""
    return native_name.replace("NaiveMoe", "Experts")


_NATIVE_CLASSES: dict[str, list[type]] = {}


def snapshot(modeling) -> dict:
    """Every global of a modeling module and every attribute of the classes it defines (captured the first time,
    while transformers is native: a class-level patch rebinds the globals)."""
    classes = _NATIVE_CLASSES.setdefault(
        modeling.__name__,
        [v for v in vars(modeling).values() if isinstance(v, type) and v.__module__ == modeling.__name__],
    )
    values = dict(vars(modeling))
    for cls in classes:
        values.update({f"{cls.__name__}.{k}": v for k, v in vars(cls).items() if not k.endswith("_cached_value")})
    return values


def changed(before: dict, modeling) -> list[str]:
    after = snapshot(modeling)
    missing = object()
    names = set(before) | {name for name in after if "." not in name}
    return sorted(n for n in names if before.get(n, missing) is not after.get(n, missing))


def modelings(case) -> list:
    """The modeling modules whose classes the patch replaces (a multimodal model's text modeling module too)."""
    case.modeling_or_skip()
    return [importlib.import_module(name) for name in case.modeling_names]


def snapshot_all(case) -> dict:
    return {modeling.__name__: snapshot(modeling) for modeling in modelings(case)}


def changed_all(before: dict, case) -> list[str]:
    """The changed globals and class attributes of every modeling module of ``case``, as ``module.name``."""
    return sorted(f"{m.__name__}.{name}" for m in modelings(case) for name in changed(before[m.__name__], m))


@pytest.fixture(params=sorted(CASES))
def case(request):
    case = CASES[request.param]
    case.modeling_or_skip()
    return case


@pytest.fixture
def class_level(case):
    """Revert the class-level patch afterwards and check that every global of the modeling module is back."""
    modeling = case.modeling_or_skip()
    before = snapshot_all(case)
    yield modeling
    case.revert_fn()()
    assert changed_all(before, case) == []


def test_spec_lists_every_class_with_a_liger_counterpart(case):
    """The spec replaces the listed classes, and the modeling file has no other class of a kind that has a Liger
    module (RMSNorm, SwiGLU MLP, batched experts, top-k router, MLA attention, the causal LM's loss)."""
    assert swapped_class_names(spec_of(case)) == list(case.swapped)
    kinds = ("RMSNorm", "MLP", "Experts", "NaiveMoe", "TopkRouter")
    own = [
        v
        for modeling in modelings(case)
        for v in vars(modeling).values()
        if isinstance(v, type) and v.__module__ == modeling.__name__ and v.__name__ not in case.native_kept
    ]
    # the experts class is <prefix>NaiveMoe before transformers 5.9: the spec names it second
    candidates = {cls.__name__.replace("NaiveMoe", "Experts") for cls in own if cls.__name__.endswith(kinds)}
    modules = [cls for cls in own if issubclass(cls, torch.nn.Module)]  # not the output dataclasses
    mla = {cls.__name__ for cls in modules if "kv_a_proj_with_mqa" in inspect.getsource(cls.__init__)}
    assert candidates | mla <= set(case.swapped)
    assert bool(mla) is case.mla


def test_instance_patch_converts_every_listed_module(case):
    model = case.build()
    native_types = {name: type(m) for name, m in model.named_modules()}
    keys = list(model.state_dict())
    before = snapshot_all(case)

    report = case.apply_fn()(model=model)

    expected = {}
    for name, native in native_types.items():
        if experts_alias(native.__name__) in case.swapped_here:
            expected[name] = liger_type(case, native.__name__)
    assert expected, "the model has modules to replace"
    patched_types = {name: type(m) for name, m in model.named_modules()}
    assert {name: patched_types[name] for name in expected} == expected
    assert all(patched_types[n] is t for n, t in native_types.items() if n not in expected and n in patched_types)
    assert model.forward.__func__ is case.lce_forward()
    assert list(model.state_dict()) == keys
    assert changed_all(before, case) == []  # an instance patch leaves transformers' classes alone
    assert {r.target for r in report} == expected_targets(case, "{name} modules", "{name} of the instance")
    # applying again changes nothing
    again = case.apply_fn()(model=model)
    assert all(r.already for r in again) and len(again) == len(report)


def expected_targets(case, class_target: str, method_target: str) -> set[str]:
    """Report targets of a default patch: the listed classes and methods this transformers version defines, each
    formatted with its ``name`` and the ``module`` defining it."""
    targets = set()
    for name in case.swapped_here:
        owner, _, method = name.partition(".")
        for modeling in modelings(case):
            if not method:
                experts = (name, name.replace("Experts", "NaiveMoe"))
                found = [n for n in experts if n in vars(modeling)]
                if found:  # a router class absent where the MoE block routes (DeepSeek-V2 before transformers 5.17)
                    targets.add(class_target.format(name=found[0], module=modeling.__name__))
            elif owner in vars(modeling) and method in vars(getattr(modeling, owner)):
                targets.add(method_target.format(name=name, module=modeling.__name__))
    return targets


def loss_and_grads(model, input_ids):
    """One forward and backward from zeroed gradients: the loss and every gradient."""
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def train(model, batches, weights=None):
    """SGD over ``batches``: the loss and every gradient of each step; with a list ``weights``, the state dict
    before each step is appended to it."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.train()
    steps = []
    for input_ids in batches:
        if weights is not None:
            weights.append({name: value.detach().clone() for name, value in model.state_dict().items()})
        steps.append(loss_and_grads(model, input_ids))
        optimizer.step()
    return steps


def gradients_at(model, weights, batches):
    """The loss and every gradient of ``model`` at each state dict of ``weights``, with one batch each."""
    model.train()
    steps = []
    for state, input_ids in zip(weights, batches):
        own = model.state_dict()
        model.load_state_dict({name: value.to(own[name].dtype) for name, value in state.items()})
        steps.append(loss_and_grads(model, input_ids))
    return steps


def assert_trains_as_native(case, patched, native) -> None:
    """Native against patched over SGD on ``batches(case)`` from the same weights: equal within RTOL; for a case with
    ``fp64_reference``, every loss and gradient no further from an fp64 native run (relative L2) than 4x native fp32's
    worst distance over the run (a wrong kernel gives errors of order one, rounding stays at native's level). There
    both fp32 models are measured at the fp64 run's weights of each step: a clamped SwiGLU or a top-k turns rounding
    differences between two trajectories into jumps of the gradient, which say nothing of the kernels."""
    if not case.fp64_reference:
        assert_steps_close(train(patched, batches(case)), train(native, batches(case)))
        return
    reference = copy.deepcopy(native).double()
    reference.set_experts_implementation("eager")  # torch's grouped GEMM has no fp64
    weights = []
    exact = train(reference, batches(case), weights)

    def distances(steps):
        return [
            [abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())]
            + [(grads[n].double() - ref).norm().item() / ref.norm().item() for n, ref in ref_grads.items() if ref.any()]
            for (loss, grads), (ref_loss, ref_grads) in zip(steps, exact)
        ]

    native_worst = max(max(step) for step in distances(gradients_at(native, weights, batches(case))))
    bound = max(RTOL, 4 * native_worst)
    for step, errors in enumerate(distances(gradients_at(patched, weights, batches(case)))):
        assert max(errors) <= bound, f"step {step}: {max(errors):.3e} from fp64, native fp32's worst {native_worst:.3e}"


def assert_steps_close(patched, native) -> None:
    for step, ((loss, grads), (ref_loss, ref_grads)) in enumerate(zip(patched, native)):
        torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=0, msg=lambda m: f"step {step} loss: {m}")
        assert grads.keys() == ref_grads.keys()
        for name, ref in ref_grads.items():
            # relative to the tensor's scale: entries near zero differ by rounding of the large ones
            atol = RTOL * ref.abs().max().item()
            torch.testing.assert_close(grads[name], ref, rtol=RTOL, atol=atol, msg=lambda m: f"step {step} {name}: {m}")


def batches(case):
    generator = torch.Generator().manual_seed(7)
    vocab = case.vocab_size
    steps = FP64_REFERENCE_STEPS if case.fp64_reference else STEPS
    return [torch.randint(0, vocab, (2, 8), generator=generator) for _ in range(steps)]


def test_instance_patch_trains_as_native(case):
    native = case.build()
    patched = copy.deepcopy(native)
    case.apply_fn()(model=patched)
    assert_trains_as_native(case, patched, native)


@pytest.mark.slow  # every model built under the class-level patch and trained: minutes in all on the interpreter
def test_class_patch_builds_the_models_own_modules_and_trains_as_native(case, class_level):
    native = case.build()
    case.apply_fn()()
    patched = case.build()
    patched.load_state_dict(native.state_dict())
    types = {type(m) for m in patched.modules()}
    native_built = {t for t in types if experts_alias(t.__name__) in case.swapped_here}
    assert not native_built, "a native module was built under the class patch"
    if case.mla and f"{case.prefix}Attention" in case.swapped_here:  # q/kv norms: the model's own, under its swap
        attention = case.decoder_of(patched).layers[0].self_attn
        assert type(attention) is liger_type(case, f"{case.prefix}Attention")
        assert type(attention.kv_a_layernorm) is LigerRMSNorm
    assert_trains_as_native(case, patched, native)


def test_latest_call_and_revert_on_an_instance(case):
    model = case.build()
    native_types = {name: type(m) for name, m in model.named_modules()}
    case.apply_fn()(model=model)
    case.apply_fn()(rms_norm=False, model=model)
    assert not any(isinstance(m, LigerRMSNorm) for m in model.modules())
    kept = LigerSwiGLUMLP if case.swiglu else liger_type(case, f"{case.prefix}TopkRouter")  # the other swaps stay
    assert any(isinstance(m, kept) for m in model.modules())
    restored = case.revert_fn()(model=model)
    assert restored and {name: type(m) for name, m in model.named_modules()} == native_types
    assert "forward" not in vars(model)
    assert case.revert_fn()(model=model) == []


def test_class_patch_rebinds_exactly_the_listed_globals(case, class_level):
    before = snapshot_all(case)
    report = case.apply_fn()()
    targets = expected_targets(case, "{module}.{name}", "{module}.{name}")
    assert {r.target for r in report} == targets
    assert set(changed_all(before, case)) == targets | no_split_lists_naming_swapped_classes(case)
    assert all(r.already for r in case.apply_fn()())


def no_split_lists_naming_swapped_classes(case) -> set[str]:
    """The ``_no_split_modules`` class attributes that name a swapped class: the patch adds the replacement's name
    there (``device_map="auto"`` and FSDP find blocks by class name)."""
    swapped = set(case.swapped_here)
    return {
        f"{m.__name__}.{cls.__name__}._no_split_modules"
        for m in modelings(case)
        for cls, names in own_no_split_lists(m).items()
        if swapped & set(names or ())
    }


def test_an_instance_of_another_model_is_refused(case):
    from tiny_models import build_model
    from tiny_models import tiny_deepseek_v3_config

    with pytest.raises(TypeError, match=f"liger-dspine: the {case.model_type} patch needs a {case.base_name}"):
        case.apply_fn()(model=build_model(tiny_deepseek_v3_config()))


@pytest.mark.parametrize("model_type", ["glm4_moe", "dots1"])
def test_gqa_models_refuse_rope(model_type):
    apply = MODEL_TYPE_TO_APPLY_LIGER_FN[model_type]
    with pytest.raises(ValueError, match=f"liger-dspine: the {model_type} patch leaves its GQA attention native"):
        apply(rope=True)
    assert inspect.signature(apply).parameters["rope"].default is False


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa"])
def test_dsa_attention_takes_the_liger_forward_where_the_latents_are_cached(model_type):
    """transformers 5.24 caches the DSA attention's latents: the default patch swaps it. Earlier versions cache the
    expanded key and value: the default leaves it native and rope=True is refused by name."""
    case = CASES[model_type]
    case.modeling_or_skip()
    apply = MODEL_TYPE_TO_APPLY_LIGER_FN[model_type]
    assert inspect.signature(apply).parameters["rope"].default is None
    model = case.build()
    if f"{case.prefix}Attention" in case.swapped_here:
        apply(model=model, rope=True)
        assert type(case.decoder_of(model).layers[0].self_attn) is liger_type(case, f"{case.prefix}Attention")
        return
    with pytest.raises(ValueError, match=f"liger-dspine: the {model_type} patch leaves its MLA attention with the DSA"):
        apply(model=model, rope=True)
    apply(model=model)
    assert type(case.decoder_of(model).layers[0].self_attn).__module__.startswith("transformers.")


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa"])
def test_dsa_greedy_generation_with_the_cache_matches_native(model_type):
    case = CASES[model_type]
    case.modeling_or_skip()
    if f"{case.prefix}Attention" not in case.swapped_here:
        pytest.skip("this transformers keeps the DSA attention native")
    native = case.build().eval()
    patched = copy.deepcopy(native)
    case.apply_fn()(model=patched)
    input_ids = torch.randint(0, case.vocab_size, (2, 6), generator=torch.Generator().manual_seed(3))
    expected = native.generate(input_ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(patched.generate(input_ids, max_new_tokens=5, do_sample=False), expected)


def test_a_model_missing_from_transformers_is_named():
    from liger_dspine.models.deepseek_v3.apply import apply_spec

    spec = patching.PatchSpec("future_model", "transformers.models.future_model.modeling_future_model", (), ())
    with pytest.raises(ImportError, match=r"liger-dspine: transformers \S+ has no future_model model"):
        apply_spec(spec, {})


def test_auto_model_patches_the_classes_then_builds(case, class_level):
    from liger_dspine import AutoLigerDSpineForCausalLM

    model = AutoLigerDSpineForCausalLM.from_config(
        case.config(), fused_linear_cross_entropy=False, **case.apply_options
    )
    types = {type(m) for m in model.modules()}
    assert any(issubclass(t, LigerRMSNorm) for t in types) and (LigerSwiGLUMLP in types) is case.swiglu
    assert not {t for t in types if t.__name__ in case.swapped_here}
    assert type(model).forward is getattr(class_level, case.causal_lm_name).forward  # the loss stays native
    assert type(model).forward.__module__ == class_level.__name__


def test_inspect_reports_the_swaps_of_a_saved_config(case, capsys, tmp_path):
    from liger_dspine.cli import main

    case.config().save_pretrained(tmp_path)
    assert main(["inspect", str(tmp_path / "config.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"liger-dspine patch for {case.model_type} (instance level):"
    targets = {line.split(" x")[0].strip() for line in lines[1:]}
    opt_in = {f"{name} modules" for name in case.opt_in}  # inspect reports the default options
    assert targets == expected_targets(case, "{name} modules", "{name} of the instance") - opt_in


def test_recompute_attention_after_a_default_instance_patch_gives_the_native_loss(case):
    if "recompute_attention" not in inspect.signature(case.apply_fn()).parameters:
        pytest.skip("this patch has no recompute_attention")
    if not (case.mla and f"{case.prefix}Attention" in case.swapped_here):
        pytest.skip("this transformers keeps the attention native")
    native = case.build()
    patched = copy.deepcopy(native)
    case.apply_fn()(model=patched)
    case.apply_fn()(model=patched, recompute_attention=True)
    attention = type(case.decoder_of(patched).layers[0].self_attn)
    assert attention.__name__ == f"Liger{case.prefix}RecomputeAttention"
    input_ids = batches(case)[0]
    (loss, grads), (ref_loss, ref_grads) = loss_and_grads(patched, input_ids), loss_and_grads(native, input_ids)
    assert_steps_close([(loss, grads)], [(ref_loss, ref_grads)])


def test_inspect_by_model_type_builds_its_default_config(case, capsys):
    from liger_dspine.cli import main

    assert main(["inspect", case.model_type]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"liger-dspine patch for {case.model_type} (instance level):" in lines
