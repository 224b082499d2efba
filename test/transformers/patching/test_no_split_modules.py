"""``_no_split_modules`` after a patch: the blocks ``device_map="auto"`` keeps whole and FSDP's default policy wraps
are found by class name, so a swapped block class (DeepSeek-V4's decoder layer) must be named there too; a revert
puts the original lists back, the same objects."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tiny_family import CASES  # noqa: E402
from tiny_family import own_no_split_lists  # noqa: E402

NATIVE_ATTRIBUTE = "_liger_dspine_native_no_split_modules"


def blocks(model) -> list[str]:
    """The paths of the modules ``_no_split_modules`` names, as accelerate finds them."""
    names = model._no_split_modules
    return [path for path, module in model.named_modules() if type(module).__name__ in names]


@pytest.fixture(params=sorted(CASES))
def case(request):
    return CASES[request.param]


@pytest.mark.matrix
def test_class_level_patch_keeps_every_block_named(case):
    modeling = case.modeling_or_skip()
    before = own_no_split_lists(modeling)
    native_blocks = blocks(case.build())
    assert native_blocks, f"{case.model_type}: the native model has no block that _no_split_modules names"
    case.apply_fn()()
    try:
        patched = case.build()
        assert blocks(patched) == native_blocks
    finally:
        case.revert_fn()()
    after = own_no_split_lists(modeling)
    assert after.keys() == before.keys()
    assert all(after[cls] is before[cls] for cls in before), f"{case.model_type}: a _no_split_modules list not restored"


@pytest.mark.matrix
def test_instance_patch_keeps_every_block_named_and_reverts(case):
    model = case.build()
    native_blocks = blocks(model)
    holders = [m for m in model.modules() if "_no_split_modules" in vars(m)]
    originals = [vars(m)["_no_split_modules"] for m in holders]
    native_sets = [set(names) for names in originals]
    case.apply_fn()(model=model)
    assert blocks(model) == native_blocks
    case.revert_fn()(model=model)
    for holder, original, names in zip(holders, originals, native_sets):
        assert vars(holder)["_no_split_modules"] is original and set(original) == names
        assert NATIVE_ATTRIBUTE not in vars(holder)


def test_deepseek_v4_class_level_patch_plans_a_disk_offload_with_whole_layers():
    """What ``from_pretrained(device_map="auto", max_memory=...)`` plans: part of the model on the CPU, the rest on
    disk, each decoder layer on one of them (the native class name alone matches no patched layer, and the planner
    fails)."""
    from accelerate.utils import infer_auto_device_map

    case = CASES["deepseek_v4"]
    case.modeling_or_skip()
    case.apply_fn()()
    try:
        model = case.build()
        layers = [path for path, module in model.named_modules() if type(module).__name__.endswith("DecoderLayer")]
        assert layers and all(type(model.get_submodule(p)).__name__.startswith("Liger") for p in layers)
        size = sum(p.numel() * p.element_size() for p in model.parameters())
        plan = infer_auto_device_map(
            model, max_memory={"cpu": size // 2, "disk": 4 * size}, no_split_module_classes=model._no_split_modules
        )
    finally:
        case.revert_fn()()
    assert set(plan.values()) == {"cpu", "disk"}
    for layer in layers:
        assert not any(key.startswith(layer + ".") for key in plan), f"{layer} was split: {sorted(plan)}"
