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
clamped SwiGLU, expert biases). A module the replacement's ``kept_native_reason(module)`` names a reason for (an
activation its kernel does not fuse, a routing layout its kernel does not reproduce) stays native instead: a warning
and the report's ``kept_native`` entries say so. At class level such a replacement builds or runs the native module
itself (``replaced_native_class``).

A replacement ``forward`` carries the native forward's annotations, signature and docstring on the class it is bound
to (``dressed``): transformers reads them (the output-recording checks read the return annotation).

A spec may also list ``ModuleCheck``s: what the modules of a model must hold according to its config (submodules,
tensor shapes). An instance patch runs them before it swaps anything and refuses a model that fails one.
"""

import importlib
import inspect
import logging
import sys
from dataclasses import dataclass
from dataclasses import field
from types import CellType
from types import FunctionType
from types import MethodType
from typing import Callable

import torch.nn as nn

from liger_dspine.modules.parallel_state import full_shape
from liger_dspine.modules.parallel_state import rewrapped_class
from liger_dspine.modules.parallel_state import unwrapped_class
from liger_dspine.no_split_names import renamed_classes
from liger_dspine.no_split_names import sync_class_attributes
from liger_dspine.no_split_names import sync_instance

logger = logging.getLogger(__name__)


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
class KeptNative:
    """A module (or a module's method) a swap leaves native, since its replacement would not compute it."""

    path: str  # the module's path in the model
    native: str  # what it stays: its class, or "Class.method"
    replacement: str  # what the swap would have put there
    reason: str


@dataclass
class PatchReport:
    """What an apply call replaced, old -> new, and what it kept native; ``str()`` gives one line per entry."""

    model_type: str
    scope: str  # "class" or "instance"
    replacements: list[Replacement] = field(default_factory=list)
    kept_native: list[KeptNative] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"liger-dspine patch for {self.model_type} ({self.scope} level):"]
        if not self.replacements:
            lines.append("  nothing replaced")
        for r in self.replacements:
            count = f" x{r.count}" if r.count is not None else ""
            state = " (already patched)" if r.already else " (restored: option off)" if r.restored else ""
            lines.append(f"  {r.target}{count}: {r.old} -> {r.new}{state}")
        for k in self.kept_native:
            lines.append(f"  kept native: {k.path} ({k.native}, not {k.replacement}): {k.reason}")
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


def original_global(module_name: str, name: str):
    """``module_name.name`` as it was before any class-level swap of this package."""
    return _original(importlib.import_module(module_name), name)


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


def replacement_of(func):
    """The replacement a bound function was made from (``dressed``): ``func`` itself for any other."""
    return getattr(func, _DRESSED_FROM, func)


_DRESSED_FROM = "_liger_dspine_replacement"  # attribute of a dressed copy: the replacement it copies
_DRESSED: dict[tuple[Callable, Callable], FunctionType] = {}


def dressed(new, native):
    """``new`` as a function carrying ``native``'s ``__annotations__``, ``__signature__`` (the native parameters,
    then ``new``'s own keyword parameters the native lacks) and ``__doc__``; name, module and code stay ``new``'s. One
    copy per pair, so applying again binds the same object; ``replacement_of`` gives ``new`` back."""
    new = replacement_of(new)
    if not isinstance(new, FunctionType) or not isinstance(native, FunctionType) or new is native:
        return new
    copy = _DRESSED.get((new, native))
    if copy is None:
        closure = _closure_for_copy(new)
        copy = FunctionType(new.__code__, new.__globals__, new.__name__, new.__defaults__, closure)
        for cell, old in zip(closure or (), new.__closure__ or ()):
            if cell is not old:  # the function's reference to itself
                cell.cell_contents = copy
        copy.__dict__.update(new.__dict__)
        copy.__kwdefaults__ = new.__kwdefaults__
        copy.__qualname__ = new.__qualname__
        copy.__module__ = new.__module__
        copy.__doc__ = native.__doc__
        copy.__annotations__ = dict(native.__annotations__)
        copy.__signature__ = _merged_signature(new, native)
        setattr(copy, _DRESSED_FROM, new)
        _DRESSED[(new, native)] = copy
    return copy


def _closure_for_copy(function: FunctionType) -> tuple[CellType, ...] | None:
    """``function``'s closure for a copy of it: a cell that holds ``function`` itself becomes a new cell (for the
    copy, once it exists), the others are shared. transformers' ``GradientCheckpointingLayer``
    wraps each subclass's ``forward`` in a function that checkpoints only when it is the class's ``forward`` (it
    finds itself in its closure): a copy must find the copy, or checkpointing never runs."""
    if not function.__closure__:
        return function.__closure__
    return tuple(CellType() if _holds(cell, function) else cell for cell in function.__closure__)


def _holds(cell: CellType, value) -> bool:
    try:
        return cell.cell_contents is value
    except ValueError:  # an empty cell
        return False


def _merged_signature(new, native) -> inspect.Signature:
    """``native``'s signature (those of its parameters ``new`` takes, every one when ``new`` takes ``**kwargs``),
    with ``new``'s other named parameters as keyword-only ones before ``**kwargs``."""
    own = inspect.signature(new).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in own.values())
    native_signature = inspect.signature(native)
    params = [p for p in native_signature.parameters.values() if takes_any or p.name in own]
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    extra = [
        p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
        for p in own.values()
        if p.name not in native_signature.parameters and p.kind in named and p.default is not inspect.Parameter.empty
    ]
    at = next((i for i, p in enumerate(params) if p.kind is inspect.Parameter.VAR_KEYWORD), len(params))
    return native_signature.replace(parameters=params[:at] + extra + params[at:])


def _dress_forward(new, native) -> None:
    """A replacement class derived from the native one (``Liger<Native>``) gets a ``forward`` of its own carrying the
    native forward's annotations, signature and docstring (``dressed``), once."""
    if not (isinstance(new, type) and isinstance(native, type) and issubclass(new, native)):
        return
    forward, native_forward = inspect.getattr_static(new, "forward"), inspect.getattr_static(native, "forward")
    if replacement_of(forward) is native_forward or getattr(forward, _DRESSED_FROM, None) is not None:
        return
    setattr(new, "forward", dressed(forward, native_forward))


def _bound_replacement(new, native, attribute: str):
    """What a class-level swap binds: a replacement ``forward`` dressed as the native one; a class, its forward
    dressed (``_dress_forward``); anything else as it is."""
    if isinstance(new, type):
        _dress_forward(new, native)
        return new
    return dressed(new, native) if attribute == "forward" else new


def kept_native_reason(replacement, module) -> str | None:
    """Why ``replacement`` leaves ``module`` native (its ``kept_native_reason(module)`` hook), or None."""
    hook = getattr(replacement, "kept_native_reason", None)
    return None if hook is None else hook(module)


_WARNED_KEPT_NATIVE: set[tuple[str, str]] = set()


def warn_kept_native(what: str, reason: str) -> None:
    """Log once per ``what`` (a class, or a class's method) and reason that it stays native."""
    if (what, reason) in _WARNED_KEPT_NATIVE:
        return
    _WARNED_KEPT_NATIVE.add((what, reason))
    logger.warning("liger-dspine: %s stays native (transformers' own computation): %s", what, reason)


def _keep_native(report: PatchReport, path: str, module, new, native: str) -> bool:
    """Whether ``new`` leaves ``module`` native; if so a warning and a report entry say why."""
    reason = kept_native_reason(new, module)
    if reason is None:
        return False
    warn_kept_native(f"{native} (for {new.__name__})", reason)
    report.kept_native.append(KeptNative(path or "(the model)", native, new.__name__, reason))
    return True


def replaced_native_class(replacement: type) -> type | None:
    """The native class a class-level swap put ``replacement`` in place of, for a module being built now: that of the
    modeling module whose code builds it (the nearest caller in a module whose global holds ``replacement``), else
    the only one; None where no class-level swap holds ``replacement`` (or which one is ambiguous)."""
    held: dict[str, set] = {}
    for (module_name, name), original in _ORIGINALS.items():
        module = sys.modules.get(module_name)
        if isinstance(original, type) and module is not None and vars(module).get(name) is replacement:
            held.setdefault(module_name, set()).add(original)
    frame = sys._getframe(1)
    while frame is not None:
        natives = held.get(frame.f_globals.get("__name__"))
        if natives:
            return next(iter(natives)) if len(natives) == 1 else None
        frame = frame.f_back
    natives = set().union(*held.values())
    return next(iter(natives)) if len(natives) == 1 else None


def native_method(instance, method: str, replacement):
    """The function ``instance.method`` would call without ``replacement`` (a class-level swap of a class in its
    MRO): for a replacement that computes some inputs with transformers' own method."""
    for cls in type(instance).__mro__:
        if method not in vars(cls):
            continue
        found = _ORIGINALS.get((cls.__module__, f"{cls.__qualname__}.{method}"), vars(cls)[method])
        if replacement_of(found) is not replacement:
            return found
    raise RuntimeError(f"liger-dspine: {type(instance).__name__} has no native {method} besides {replacement}")


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
            if replacement_of(current) is new and on:
                continue
            if replacement_of(current) is not new and not on:
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
        if replacement_of(current) is new:
            report.replacements.append(
                Replacement(target, qualified_name(_ORIGINALS[key]), qualified_name(new), None, True)
            )
            continue
        _ORIGINALS.setdefault(key, current)
        setattr(holder, attribute, _bound_replacement(new, _ORIGINALS[key], attribute))
        report.replacements.append(Replacement(target, qualified_name(current), qualified_name(new)))
    _sync_class_no_split_modules(spec)
    return report


def _sync_class_no_split_modules(spec: PatchSpec) -> None:
    """The spec's modeling modules' ``_no_split_modules`` name the replacement classes their globals now hold."""
    held = (
        (original, vars(sys.modules[module_name]).get(name)) for (module_name, name), original in _ORIGINALS.items()
    )
    renamed = renamed_classes((old, new) for old, new in held if isinstance(old, type) and isinstance(new, type))
    # a modeling module not imported yet holds no swap (and this transformers may not have it)
    module_names = {spec.module} | {swap.module for swap in spec.swaps if swap.module}
    sync_class_attributes([sys.modules[name] for name in sorted(module_names) if name in sys.modules], renamed)


def _undo_class_swap(spec: PatchSpec, swap, report: PatchReport) -> None:
    """Put back the original of a swap whose option is off, where the global still holds its replacement."""
    for key in _target_keys(spec, swap):
        module_name, name = key
        if key not in _ORIGINALS:
            continue
        holder, attribute = _holder(swap, key)
        new = load_object(swap.replacement)
        if replacement_of(vars(holder).get(attribute)) is not new:
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
    _sync_class_no_split_modules(spec)
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
            _dress_forward(new, old)
            converted = already = 0
            for path, module in model.named_modules():
                if not isinstance(module, (old, new)):
                    continue
                if _keep_native(report, path, module, new, type(module).__name__):
                    continue
                if isinstance(module, new):
                    already += 1
                else:
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
            for path, instance in model.named_modules():
                if not isinstance(instance, owner):
                    continue
                if _keep_native(report, path, instance, new, f"{type(instance).__name__}.{swap.method}"):
                    continue
                effective = _effective_method(instance, swap.method)
                if _bound_method(instance, swap.method) is not new:
                    # bound even where a class-level patch put the same function on the class (reported as
                    # already patched): the instance patch then outlives a revert of the class level
                    setattr(instance, swap.method, MethodType(new, instance))
                if replacement_of(effective) is new:
                    already += 1
                else:
                    converted += 1
            target = f"{swap.owner}.{swap.method} of the instance"
            native = original_method(swap.module or spec.module, swap.owner, swap.method)
            _record_conversions(report, target, native, new, converted, already)
    converted = (m for m in model.modules() if _CONVERTED_FROM in vars(m))
    sync_instance(
        model, renamed_classes((unwrapped_class(vars(m)[_CONVERTED_FROM]), unwrapped_class(type(m))) for m in converted)
    )
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
            if isinstance(module, new) or not isinstance(module, old) or kept_native_reason(new, module):
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
        if isinstance(instance, owner) and replacement_of(getattr(type(instance), swap.method)) not in accepted:
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
            if unwrapped_class(type(module)) is new and _CONVERTED_FROM not in module.__dict__:
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
            native = module.__dict__.get(_CONVERTED_FROM)
            if unwrapped_class(type(module)) is not new or native is None or unwrapped_class(native) is not old:
                continue
            del module.__dict__[_CONVERTED_FROM]
            module.__class__ = native  # FSDP<Native> for a module FSDP2 had wrapped
            restored += 1
        _record_restored(report, f"{new.__name__} modules", new, old, restored)
        return
    owner = getattr(importlib.import_module(swap.module or spec.module), swap.owner)
    if swap.method not in vars(owner):
        return  # this version has no such method: nothing was applied
    restored = 0
    for instance in (m for m in model.modules() if isinstance(m, owner)):
        if replacement_of(_effective_method(instance, swap.method)) is not new:
            continue
        vars(instance).pop(swap.method, None)
        if replacement_of(getattr(type(instance), swap.method)) is new:  # patched at class level: the original
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
                found = None if tensor is None else full_shape(tensor)
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
    native class that adds none only needs its class switched. The native class is noted for an undo. A module
    that FSDP2 has wrapped (``FSDP<Native>``) keeps its wrapper: it becomes ``FSDP<new>``."""
    native = type(module)
    _convert_class(module, new)
    module.__class__ = rewrapped_class(native, type(module))
    module.__dict__[_CONVERTED_FROM] = native


def _convert_class(module: nn.Module, new: type) -> None:
    convert = getattr(new, "convert", None)
    if convert is not None:
        convert(module)
    elif issubclass(new, unwrapped_class(type(module))):
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
