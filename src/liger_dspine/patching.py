"""One engine for every model: applies a declarative patch spec at class level or to one instance.

A spec lists swaps. Each swap is enabled by one option of the model's apply function and names what it replaces:
- ``ClassSwap``: a class looked up through a module global (``modeling_x.FooRMSNorm``). At class level the global
  is rebound, so models built afterwards use the replacement; on an instance, every module of the native class
  is converted in place (``module.__class__`` becomes the replacement, parameters and hooks untouched).
- ``MethodSwap``: a method of a class (``FooForCausalLM.forward``). At class level the class attribute is
  rebound; on an instance the function is bound to that instance only.

Replacements are named as ``"package.module:attribute"`` and imported only when a swap is applied, so importing
``liger_dspine`` imports no Triton kernel. The engine records every original it replaced, and ``revert`` puts back
exactly the objects it found (identity, not reload). Parameter and buffer names never change, so a patched model's
``state_dict()`` equals the native one key for key.

Applying again: the latest call describes the model, at class level and on an instance alike. A swap whose option is
on is applied (or reported as already there); a swap whose option is off is undone where an earlier call of this
package applied it. After the options are resolved, at most one enabled swap may target a class or a method.

Before an instance patch changes anything it refuses a module the replacement would compute differently: a subclass
of the native class with a forward of its own, or one the replacement's ``check_convertible(module)`` refuses (a
clamped or non-SiLU SwiGLU, expert biases).

A spec may also list ``ModuleCheck``s: what the modules of a model must hold according to its config (submodules,
tensor shapes). An instance patch runs them before it swaps anything and refuses a model that fails one.
"""

import importlib
import inspect
from dataclasses import dataclass
from dataclasses import field
from types import MethodType
from typing import Callable

import torch.nn as nn


@dataclass(frozen=True)
class ClassSwap:
    """Replace a class (or a function) that code looks up through a module global."""

    option: str
    names: tuple[str, ...]  # candidate global names, newest first (classes were renamed across versions)
    replacement: str  # "module:attribute"
    module: str | None = None  # defaults to the spec's module
    required: bool = True  # missing in every supported version is an error


@dataclass(frozen=True)
class MethodSwap:
    """Replace a method of a class (for example the causal LM's ``forward``)."""

    option: str
    owner: str
    method: str
    replacement: str
    module: str | None = None
    required: bool = True  # False: the method exists only in some supported versions


@dataclass(frozen=True)
class ModuleCheck:
    """What every module of one native class must hold, given the model's config."""

    names: tuple[str, ...]  # candidate global names of the class, newest first (as in ClassSwap)
    children: tuple[str, ...] = ()  # submodules it must have
    shapes: tuple[tuple[str, Callable], ...] = ()  # (tensor attribute, config -> its expected shape)


@dataclass(frozen=True)
class PatchSpec:
    model_type: str
    module: str  # the transformers modeling module
    base_classes: tuple[str, ...]  # "module:Class" paths; an instance patch accepts a model of any of them
    swaps: tuple[ClassSwap | MethodSwap, ...]
    checks: tuple[ModuleCheck, ...] = ()  # run on a model before an instance patch changes it


@dataclass
class Replacement:
    target: str  # "module.Class" or "module.Class.method", or the instance path of a submodule kind
    old: str
    new: str
    count: int | None = None  # modules converted, for instance patches
    already: bool = False  # found already patched: nothing changed
    restored: bool = False  # an earlier swap undone because its option is now off (old: the replacement)


@dataclass
class PatchReport:
    """What an apply call replaced, old -> new; ``str()`` gives one line per replacement."""

    model_type: str
    scope: str  # "class" or "instance"
    replacements: list[Replacement] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"liger-dspine patch for {self.model_type} ({self.scope} level):"]
        if not self.replacements:
            lines.append("  nothing replaced")
        for r in self.replacements:
            count = f" x{r.count}" if r.count is not None else ""
            state = " (already patched)" if r.already else " (restored: option off)" if r.restored else ""
            lines.append(f"  {r.target}{count}: {r.old} -> {r.new}{state}")
        return "\n".join(lines)

    def __iter__(self):
        return iter(self.replacements)

    def __len__(self) -> int:
        return len(self.replacements)


# (module name, attribute path) -> the original object found there before the first class-level swap.
_ORIGINALS: dict[tuple[str, str], object] = {}
# (module name, attribute path) -> the model types whose class-level patch holds the swap there. Two patches may
# share a class (kimi_k25's text model is DeepSeek-V3's classes): reverting one keeps what the other still holds.
_HOLDERS: dict[tuple[str, str], set[str]] = {}


def load_object(path: str):
    module_name, _, attribute = path.partition(":")
    obj = importlib.import_module(module_name)
    for part in attribute.split("."):
        obj = getattr(obj, part)
    return obj


def qualified_name(obj) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def check_options(fn: Callable, options: dict) -> None:
    """Raise TypeError naming every option ``fn`` does not take (nothing is silently dropped)."""
    params = inspect.signature(fn).parameters
    unknown = sorted(name for name in options if name not in params)
    if unknown:
        accepted = ", ".join(name for name in params if name != "model")
        raise TypeError(
            f"liger-dspine: {fn.__name__}() got unknown option(s) {', '.join(map(repr, unknown))}; "
            f"it accepts: {accepted}"
        )


def _enabled_swaps(spec: PatchSpec, options: dict[str, bool]):
    for swap in spec.swaps:
        if swap.option not in options:
            raise KeyError(
                f"liger-dspine: swap option {swap.option!r} of spec {spec.model_type!r} is not an apply option"
            )
        if options[swap.option]:
            yield swap


def _disabled_swaps(spec: PatchSpec, options: dict[str, bool]):
    enabled = set(map(id, _enabled_swaps(spec, options)))
    return [swap for swap in spec.swaps if id(swap) not in enabled]


def _target_keys(spec: PatchSpec, swap) -> list[tuple[str, str]]:
    module_name = swap.module or spec.module
    if isinstance(swap, ClassSwap):
        return [(module_name, name) for name in swap.names]
    return [(module_name, f"{swap.owner}.{swap.method}")]


def check_single_swap_per_target(spec: PatchSpec, options: dict[str, bool]) -> None:
    """At most one enabled swap per class or method; a ValueError naming the options otherwise."""
    seen: dict[tuple[str, str], str] = {}
    for swap in _enabled_swaps(spec, options):
        for key in _target_keys(spec, swap):
            if key in seen and seen[key] != swap.option:
                raise ValueError(
                    f"liger-dspine: options {seen[key]!r} and {swap.option!r} of the {spec.model_type} patch both "
                    f"replace {key[0]}.{key[1]}; enable one of them"
                )
            seen[key] = swap.option


def _resolve_class_global(spec: PatchSpec, swap: ClassSwap):
    """The module and the first of ``swap.names`` it defines, or (module, None)."""
    module = importlib.import_module(swap.module or spec.module)
    for name in swap.names:
        if name in vars(module):
            return module, name
    if swap.required:
        raise RuntimeError(
            f"liger-dspine: {module.__name__} defines none of {', '.join(swap.names)}; "
            "this transformers version is not supported by the patch"
        )
    return module, None


def native_class(spec: PatchSpec, swap: ClassSwap):
    """The class a swap replaces, as transformers defines it (even after a class-level patch)."""
    module, name = _resolve_class_global(spec, swap)
    return None if name is None else _original(module, name)


def original_method(module_name: str, owner: str, method: str):
    """``owner.method`` of ``module_name`` as it was before any class-level swap of this package."""
    module = importlib.import_module(module_name)
    return _ORIGINALS.get((module_name, f"{owner}.{method}"), vars(getattr(module, owner)).get(method))


def _original(module, name: str):
    """``module.name`` as it was before any class-level swap of this package."""
    return _ORIGINALS.get((module.__name__, name), getattr(module, name))


def _holder(swap, key: tuple[str, str]):
    """``(object, attribute)`` that a class-level swap rebinds for one of its target keys (``_target_keys``); the
    object is None where the method's owner class is missing."""
    module = importlib.import_module(key[0])
    if isinstance(swap, ClassSwap):
        return module, key[1]
    return getattr(module, swap.owner, None), swap.method


def _check_shared_targets(spec: PatchSpec, options: dict[str, bool]) -> None:
    """Refuse, before anything changes, a class-level call that would undo or replace a swap another model type's
    class-level patch holds on a class both patches share."""
    enabled = set(map(id, _enabled_swaps(spec, options)))
    for swap in spec.swaps:
        for key in _target_keys(spec, swap):
            others = sorted(_HOLDERS.get(key, set()) - {spec.model_type})
            if not others:
                continue
            holder, attribute = _holder(swap, key)
            if holder is None:
                continue
            new = load_object(swap.replacement)
            current = vars(holder).get(attribute)
            on = id(swap) in enabled
            if current is new and on:
                continue
            if current is not new and not on:
                continue
            action = "replace it by " + qualified_name(new) if on else f"undo it ({swap.option}=False)"
            raise ValueError(
                f"liger-dspine: {key[0]}.{key[1]} is {qualified_name(current)} through the class-level "
                f"{', '.join(others)} patch, which shares it with {spec.model_type}; this call would {action}. "
                f"Give both patches the same {swap.option!r}, or revert the {', '.join(others)} patch first; "
                "nothing was patched"
            )


def apply_class_level(spec: PatchSpec, options: dict[str, bool]) -> PatchReport:
    check_single_swap_per_target(spec, options)
    _check_shared_targets(spec, options)
    report = PatchReport(spec.model_type, "class")
    for swap in _disabled_swaps(spec, options):
        _undo_class_swap(spec, swap, report)
    for swap in _enabled_swaps(spec, options):
        new = load_object(swap.replacement)
        if isinstance(swap, ClassSwap):
            module, name = _resolve_class_global(spec, swap)
            if name is None:
                continue
            holder, attribute, target = module, name, f"{module.__name__}.{name}"
        else:
            module = importlib.import_module(swap.module or spec.module)
            holder, attribute = getattr(module, swap.owner), swap.method
            if attribute not in vars(holder):
                if swap.required:
                    raise RuntimeError(f"liger-dspine: {module.__name__}.{swap.owner} has no {attribute}")
                continue
            name = f"{swap.owner}.{swap.method}"
            target = f"{module.__name__}.{name}"
        current = vars(holder).get(attribute)
        key = (module.__name__, name)
        _HOLDERS.setdefault(key, set()).add(spec.model_type)
        if current is new:
            report.replacements.append(
                Replacement(target, qualified_name(_ORIGINALS[key]), qualified_name(new), None, True)
            )
            continue
        _ORIGINALS.setdefault(key, current)
        setattr(holder, attribute, new)
        report.replacements.append(Replacement(target, qualified_name(current), qualified_name(new)))
    return report


def _undo_class_swap(spec: PatchSpec, swap, report: PatchReport) -> None:
    """Put back the original of a swap whose option is off, where the global still holds its replacement."""
    for key in _target_keys(spec, swap):
        module_name, name = key
        if key not in _ORIGINALS:
            continue
        holder, attribute = _holder(swap, key)
        new = load_object(swap.replacement)
        if vars(holder).get(attribute) is not new:
            continue  # another swap of the same target holds it now
        _HOLDERS.pop(key, None)
        original = _ORIGINALS.pop(key)
        setattr(holder, attribute, original)
        report.replacements.append(
            Replacement(f"{module_name}.{name}", qualified_name(new), qualified_name(original), restored=True)
        )


def revert_class_level(spec: PatchSpec) -> list[str]:
    """Put back every original a class-level apply of ``spec`` replaced, except what another model type's
    class-level patch still holds; returns the restored targets."""
    restored = []
    for swap in spec.swaps:
        for key in _target_keys(spec, swap):
            if key not in _ORIGINALS:
                continue
            holders = _HOLDERS.get(key, set())
            holders.discard(spec.model_type)
            if holders:
                continue  # another patch applied this swap too and still holds it
            _HOLDERS.pop(key, None)
            holder, attribute = _holder(swap, key)
            setattr(holder, attribute, _ORIGINALS.pop(key))
            restored.append(f"{key[0]}.{key[1]}")
    return restored


def apply_to_instance(spec: PatchSpec, options: dict[str, bool], model: nn.Module) -> PatchReport:
    """Convert the modules of one model; module globals and other instances stay untouched."""
    bases = tuple(load_object(path) for path in spec.base_classes)
    if not isinstance(model, bases):
        expected = " or ".join(base.__name__ for base in bases)
        raise TypeError(
            f"liger-dspine: the {spec.model_type} patch needs a {expected} (or a subclass) as `model`, "
            f"got {type(model).__name__}{_wrapper_hint(model)}"
        )
    check_single_swap_per_target(spec, options)
    check_modules(spec, model)
    _check_convertible(spec, options, model)
    _check_undoable(spec, options, model)
    report = PatchReport(spec.model_type, "instance")
    for swap in _disabled_swaps(spec, options):
        _undo_instance_swap(spec, swap, model, report)
    for swap in _enabled_swaps(spec, options):
        new = load_object(swap.replacement)
        if isinstance(swap, ClassSwap):
            old = native_class(spec, swap)
            if old is None:
                continue
            if not isinstance(old, type):
                _rebind_held_references(model, old, new, report)
                continue
            converted = already = 0
            for module in model.modules():
                if isinstance(module, new):
                    already += 1
                elif isinstance(module, old):
                    _convert(module, new)
                    converted += 1
            _record_conversions(report, f"{old.__name__} modules", old, new, converted, already)
        else:
            owner = getattr(importlib.import_module(swap.module or spec.module), swap.owner)
            if swap.method not in vars(owner):
                if swap.required:
                    raise RuntimeError(f"liger-dspine: {owner.__qualname__} has no {swap.method}")
                continue
            converted = already = 0
            for instance in (m for m in model.modules() if isinstance(m, owner)):
                effective = _effective_method(instance, swap.method)
                if _bound_method(instance, swap.method) is not new:
                    # bound even where a class-level patch put the same function on the class (reported as
                    # already patched): the instance patch then outlives a revert of the class level
                    setattr(instance, swap.method, MethodType(new, instance))
                if effective is new:
                    already += 1
                else:
                    converted += 1
            target = f"{swap.owner}.{swap.method} of the instance"
            native = original_method(swap.module or spec.module, swap.owner, swap.method)
            _record_conversions(report, target, native, new, converted, already)
    return report


def _wrapper_hint(model) -> str:
    if hasattr(model, "_orig_mod"):
        return " (a torch.compile wrapper: patch `model._orig_mod`, or patch before compiling)"
    if hasattr(model, "get_base_model"):
        return " (a PEFT wrapper: patch `model.get_base_model()`)"
    return ""


_OWN_PACKAGES = ("transformers", "liger_dspine")


def _check_convertible(spec: PatchSpec, options: dict[str, bool], model: nn.Module) -> None:
    """Refuse, before anything changes, a module the replacement would compute differently: a subclass of the
    native class with a forward of its own, one the replacement's ``check_convertible`` refuses, a module of a class
    another package's patch put in transformers' place, or a model whose class overrides a method a swap binds."""
    # modules this call first turns back to their native class (an option now off), then converts again
    undone = {new for _, _, new in _class_swaps_turned_back(spec, options)}
    for swap in _enabled_swaps(spec, options):
        if isinstance(swap, MethodSwap):
            _check_method_not_overridden(spec, swap, model)
            continue
        old = native_class(spec, swap)
        if not isinstance(old, type):
            continue
        new = load_object(swap.replacement)
        check = getattr(new, "check_convertible", None)
        for path, module in model.named_modules():
            if isinstance(module, new) or not isinstance(module, old):
                continue
            if type(module) in undone:
                if check is not None:
                    check(module)
                continue
            if old.__module__.split(".")[0] not in _OWN_PACKAGES:
                raise ValueError(
                    f"liger-dspine: {path or type(model).__name__} is a {qualified_name(old)}, which another "
                    f"package's class-level patch (liger-kernel's apply_liger_kernel_to_*, ...) put in place of "
                    f"transformers' {' / '.join(swap.names)} before this model was built; {new.__name__} replaces "
                    "transformers' class only. Build the model without that patch; nothing was patched"
                )
            if type(module).forward is not old.forward:
                raise ValueError(
                    f"liger-dspine: {path or type(model).__name__} is a {type(module).__name__}, a subclass of "
                    f"{old.__name__} with a forward of its own, which {new.__name__} would not compute; nothing was "
                    "patched"
                )
            if check is not None:
                check(module)


def _check_method_not_overridden(spec: PatchSpec, swap: MethodSwap, model: nn.Module) -> None:
    """Refuse a module whose class overrides the method a swap binds: the replacement would drop its code."""
    module_name = swap.module or spec.module
    owner = getattr(importlib.import_module(module_name), swap.owner, None)
    if owner is None or swap.method not in vars(owner):
        return
    accepted = (original_method(module_name, swap.owner, swap.method), load_object(swap.replacement))
    for path, instance in model.named_modules():
        if isinstance(instance, owner) and getattr(type(instance), swap.method) not in accepted:
            raise ValueError(
                f"liger-dspine: {path or type(model).__name__} is a {type(instance).__name__}, a subclass of "
                f"{swap.owner} with a {swap.method} of its own, which the {swap.option} swap would replace by "
                f"{load_object(swap.replacement).__name__}; nothing was patched"
            )


def _check_undoable(spec: PatchSpec, options: dict[str, bool], model: nn.Module) -> None:
    """Refuse, before anything changes, to turn back a module that was built as its replacement (under a
    class-level patch): it has no native class to return to."""
    for swap, old, new in _class_swaps_turned_back(spec, options):
        for path, module in model.named_modules():
            if type(module) is new and _CONVERTED_FROM not in module.__dict__:
                raise ValueError(
                    f"liger-dspine: {path or type(model).__name__} was built as {new.__name__} (under a class-level "
                    f"patch), so it cannot be turned back into {old.__name__} with {swap.option}=False; revert the "
                    "class-level patch and build the model again; nothing was patched"
                )


def _class_swaps_turned_back(spec: PatchSpec, options: dict[str, bool]):
    """``(swap, native class, replacement)`` of every class swap whose option is off: what an instance call turns
    back to its native class."""
    for swap in _disabled_swaps(spec, options):
        if isinstance(swap, ClassSwap):
            old = native_class(spec, swap)
            if isinstance(old, type):
                yield swap, old, load_object(swap.replacement)


def _bound_method(instance, method: str):
    """The function bound to ``instance`` itself as ``method``, or None."""
    bound = vars(instance).get(method)
    return bound.__func__ if isinstance(bound, MethodType) else None


def _effective_method(instance, method: str):
    """The function ``instance.method`` calls: its own bound one, else its class's."""
    return _bound_method(instance, method) or getattr(type(instance), method)


def _undo_instance_swap(spec: PatchSpec, swap, model: nn.Module, report: PatchReport) -> None:
    """Turn back what an earlier call applied to ``model`` for a swap whose option is now off."""
    new = load_object(swap.replacement)
    if isinstance(swap, ClassSwap):
        old = native_class(spec, swap)
        if old is None:
            return
        if not isinstance(old, type):
            restored, _ = _rebind_references(model, new, old)
            _record_restored(report, f"{old.__name__} references", new, old, restored)
            return
        restored = 0
        for module in model.modules():
            # _check_undoable found the native class on every such module; another swap with the same replacement
            # (two native norm classes) turns back its own
            if type(module) is not new or module.__dict__.get(_CONVERTED_FROM) is not old:
                continue
            del module.__dict__[_CONVERTED_FROM]
            module.__class__ = old
            restored += 1
        _record_restored(report, f"{new.__name__} modules", new, old, restored)
        return
    owner = getattr(importlib.import_module(swap.module or spec.module), swap.owner)
    if swap.method not in vars(owner):
        return  # this version has no such method: nothing was applied
    restored = 0
    for instance in (m for m in model.modules() if isinstance(m, owner)):
        if _effective_method(instance, swap.method) is not new:
            continue
        vars(instance).pop(swap.method, None)
        if getattr(type(instance), swap.method) is new:  # patched at class level: this instance takes the original
            original = _ORIGINALS[((swap.module or spec.module), f"{swap.owner}.{swap.method}")]
            from liger_dspine import pickling  # the bound original pickles by where it lives

            pickling.register_original(original, swap.module or spec.module, swap.owner, swap.method)
            setattr(instance, swap.method, MethodType(original, instance))
        restored += 1
    native = original_method(swap.module or spec.module, swap.owner, swap.method)
    _record_restored(report, f"{swap.owner}.{swap.method} of the instance", new, native, restored)


def _record_restored(report: PatchReport, target: str, new, old, restored: int) -> None:
    if restored:
        report.replacements.append(
            Replacement(target, qualified_name(new), qualified_name(old), restored, restored=True)
        )


def revert_instance(spec: PatchSpec, model: nn.Module) -> PatchReport:
    """Turn every swap of ``spec`` back on ``model`` (the native classes and methods); a report of what changed."""
    return apply_to_instance(spec, {swap.option: False for swap in spec.swaps}, model)


def revert(spec: PatchSpec, model: nn.Module | None = None) -> list[str]:
    """What a ``revert_liger_kernel_to_<model>(model=None)`` does: the class level without a model, else that
    instance; returns the restored targets."""
    if model is None:
        return revert_class_level(spec)
    return [r.target for r in revert_instance(spec, model)]


def check_modules(spec: PatchSpec, model: nn.Module) -> None:
    """Raise ValueError naming every module of ``model`` that disagrees with ``model.config`` (``spec.checks``); a
    multimodal model's modules are checked against its text config."""
    config = getattr(model, "config", None)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    problems = []
    module = importlib.import_module(spec.module)
    for check in spec.checks:
        names = [name for name in check.names if name in vars(module)]
        if not names:
            continue
        native = _original(module, names[0])
        for path, submodule in model.named_modules():
            if not isinstance(submodule, native):
                continue
            where = path or type(model).__name__
            for child in check.children:
                if not isinstance(getattr(submodule, child, None), nn.Module):
                    problems.append(f"{where}.{child} is missing (every {native.__name__} has one)")
            for attribute, expected_shape in check.shapes:
                expected = tuple(expected_shape(config))
                tensor = getattr(submodule, attribute, None)
                found = None if tensor is None else tuple(tensor.shape)
                if found != expected:
                    problems.append(f"{where}.{attribute} has shape {found}; the config implies {expected}")
    if problems:
        raise ValueError(
            f"liger-dspine: this {type(model).__name__} does not match its config, so the {spec.model_type} patch "
            "would compute with the wrong sizes; nothing was patched:\n  " + "\n  ".join(problems)
        )


_CONVERTED_FROM = "_liger_dspine_native_class"  # instance attribute: the native class a module was converted from


def _convert(module: nn.Module, new: type) -> None:
    """Turn a native module into ``new`` in place: its ``convert`` sets any state it adds; a subclass of the
    native class that adds none only needs its class switched. The native class is noted for an undo."""
    native = type(module)
    _convert_class(module, new)
    module.__dict__[_CONVERTED_FROM] = native


def _convert_class(module: nn.Module, new: type) -> None:
    convert = getattr(new, "convert", None)
    if convert is not None:
        convert(module)
    elif issubclass(new, type(module)):
        module.__class__ = new
    else:
        raise TypeError(f"liger-dspine: {new.__name__} cannot convert a {type(module).__name__} in place")


def _rebind_held_references(model: nn.Module, old, new, report: PatchReport) -> None:
    """For a function global: point the attributes of ``model``'s modules that hold ``old`` to ``new``."""
    converted, already = _rebind_references(model, old, new)
    _record_conversions(report, f"{old.__name__} references", old, new, converted, already)


def _rebind_references(model: nn.Module, old, new) -> tuple[int, int]:
    """Point every module attribute of ``model`` that holds ``old`` to ``new``: (rebound, already ``new``)."""
    rebound = already = 0
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if value is old:
                setattr(module, name, new)
                rebound += 1
            elif value is new:
                already += 1
    return rebound, already


def _record_conversions(report: PatchReport, target: str, old, new, converted: int, already: int) -> None:
    """One report line for an instance swap; "already patched" when nothing had to change."""
    if converted or already:
        report.replacements.append(
            Replacement(target, qualified_name(old), qualified_name(new), converted or already, already=not converted)
        )
