"""Keep ``_no_split_modules`` true to a patched model's classes.

transformers and accelerate find a model's blocks by class name: ``device_map="auto"`` keeps every module whose
class is named in ``_no_split_modules`` on one device, and FSDP's default wrap policy wraps those modules. A swap of
such a class (DeepSeek-V4's ``DeepseekV4DecoderLayer`` becomes ``LigerDeepseekV4DecoderLayer``) would leave the name
without a module, so the planner finds no block and FSDP wraps none.

The replacement's name is added beside the native one, never in its place (a model may hold both), and the lists go
back to their original objects once no swap holds them.
"""

import torch.nn as nn

_ATTRIBUTE = "_no_split_modules"
# (class, the ``_no_split_modules`` it defined before any class-level swap)
_CLASS_ORIGINALS: dict[type, object] = {}
_INSTANCE_ORIGINAL = "_liger_dspine_native_no_split_modules"  # instance attribute: the set before the first swap


def _with_replacements(original, renamed: dict[str, set[str]]) -> list[str]:
    names = list(original or ())
    for name in list(names):
        names += sorted(renamed.get(name, set()) - set(names))
    return names


def sync_class_attributes(modules, renamed: dict[str, set[str]]) -> None:
    """For every class a modeling module in ``modules`` defines with a ``_no_split_modules`` of its own: the native
    names plus the classes ``renamed`` maps them to (native name -> the replacements' names that modules built now
    get); the original object again where ``renamed`` adds nothing."""
    for module in modules:
        for cls in list(vars(module).values()):
            if not isinstance(cls, type) or cls.__module__ != module.__name__ or _ATTRIBUTE not in vars(cls):
                continue
            original = _CLASS_ORIGINALS.get(cls, vars(cls)[_ATTRIBUTE])
            names = _with_replacements(original, renamed)
            if names == list(original or ()):
                _CLASS_ORIGINALS.pop(cls, None)
                setattr(cls, _ATTRIBUTE, original)
                continue
            _CLASS_ORIGINALS.setdefault(cls, original)
            setattr(cls, _ATTRIBUTE, type(original)(names) if isinstance(original, (list, set, tuple)) else names)


def sync_instance(model: nn.Module, converted: dict[nn.Module, type], name_of) -> None:
    """For ``model`` and every submodule holding its own ``_no_split_modules`` (transformers' ``post_init`` makes
    one per pretrained model): the native set plus the class names of the modules ``converted`` maps (module -> the
    native class it was converted from), ``name_of(module)`` naming each; the original set where none is left."""
    renamed: dict[str, set[str]] = {}
    for module, native in converted.items():
        renamed.setdefault(native.__name__, set()).add(name_of(module))
    for module in model.modules():
        own = vars(module)
        if _ATTRIBUTE not in own and _INSTANCE_ORIGINAL not in own:
            continue
        original = own.get(_INSTANCE_ORIGINAL, own.get(_ATTRIBUTE))
        names = _with_replacements(original, renamed)
        if names == list(original or ()):
            if _INSTANCE_ORIGINAL in own:
                setattr(module, _ATTRIBUTE, own.pop(_INSTANCE_ORIGINAL))
            continue
        own.setdefault(_INSTANCE_ORIGINAL, original)
        setattr(module, _ATTRIBUTE, type(original)(names) if isinstance(original, (list, set, tuple)) else names)
