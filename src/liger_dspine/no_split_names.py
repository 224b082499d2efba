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


def renamed_classes(pairs) -> dict[str, set[str]]:
    """native class name -> the names of the classes that replace it, from ``(native, replacement)`` class pairs."""
    renamed: dict[str, set[str]] = {}
    for native, replacement in pairs:
        if replacement.__name__ != native.__name__:
            renamed.setdefault(native.__name__, set()).add(replacement.__name__)
    return renamed


def _with_replacements(original, renamed: dict[str, set[str]]):
    """``original``'s names, each followed by the names ``renamed`` maps it to, in ``original``'s type; None where
    that adds nothing."""
    names = list(original or ())
    for name in list(names):
        names += sorted(renamed.get(name, set()) - set(names))
    if len(names) == len(original or ()):
        return None
    return type(original)(names) if isinstance(original, (list, set, tuple)) else names


def sync_class_attributes(modules, renamed: dict[str, set[str]]) -> None:
    """For every class a modeling module in ``modules`` defines with a ``_no_split_modules`` of its own: the native
    names plus those ``renamed`` maps them to (the replacements that modules built now get); the original object
    again where that adds nothing."""
    for module in modules:
        for cls in list(vars(module).values()):
            if not isinstance(cls, type) or cls.__module__ != module.__name__ or _ATTRIBUTE not in vars(cls):
                continue
            original = _CLASS_ORIGINALS.pop(cls, vars(cls)[_ATTRIBUTE])
            names = _with_replacements(original, renamed)
            if names is not None:
                _CLASS_ORIGINALS[cls] = original
            setattr(cls, _ATTRIBUTE, original if names is None else names)


def sync_instance(model: nn.Module, renamed: dict[str, set[str]]) -> None:
    """The same for ``model`` and every submodule holding its own ``_no_split_modules`` (transformers' ``post_init``
    makes one per pretrained model), ``renamed`` from the modules converted in it."""
    for module in model.modules():
        own = vars(module)
        if _ATTRIBUTE not in own and _INSTANCE_ORIGINAL not in own:
            continue
        original = own.pop(_INSTANCE_ORIGINAL, own.get(_ATTRIBUTE))
        names = _with_replacements(original, renamed)
        if names is not None:
            own[_INSTANCE_ORIGINAL] = original
        setattr(module, _ATTRIBUTE, original if names is None else names)
