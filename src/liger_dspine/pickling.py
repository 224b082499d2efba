"""Pickling of instance-patched models (``pickle``, ``torch.save(model)``, ``copy.deepcopy`` is unaffected).

An instance patch binds a replacement function to one module: ``model.forward = MethodType(lce_forward, model)``.
Python pickles a bound method as ``getattr(instance, "lce_forward")``, which the loaded model does not have. For the
replacement functions registered here, a ``copyreg`` reducer pickles the function by its qualified name and binds it
again at load, so a loaded model is patched as the saved one was. Every other bound method keeps its own reduction.
"""

import copyreg
from types import MethodType

from liger_dspine.patching import MethodSwap
from liger_dspine.patching import PatchSpec
from liger_dspine.patching import load_object

_REPLACEMENTS: set = set()
_ORIGINAL_KEYS: dict = {}  # a native method bound to one instance (an option turned off) -> (module, owner, method)
_previous_reducer = None  # a MethodType reducer registered before ours, if any


def register(func) -> None:
    """Pickle ``func`` bound to an instance as ``func`` rebound to the loaded instance."""
    global _previous_reducer
    _REPLACEMENTS.add(func)
    current = copyreg.dispatch_table.get(MethodType)
    if current is not _reduce_method:
        _previous_reducer = current
        copyreg.pickle(MethodType, _reduce_method)


def register_original(func, module_name: str, owner: str, method: str) -> None:
    """Pickle the native ``func`` bound to an instance by where it lives, since a class-level patch may hold its
    name: at load it is looked up as the engine found it before the patch."""
    register(func)
    _ORIGINAL_KEYS[func] = (module_name, owner, method)


def bind_original(module_name: str, owner: str, method: str, instance):
    from liger_dspine.patching import original_method

    func = original_method(module_name, owner, method)
    register_original(func, module_name, owner, method)
    return MethodType(func, instance)


def register_method_swaps(spec: PatchSpec, options: dict[str, bool]) -> None:
    """Register the replacement of every method swap of ``spec`` that ``options`` enable (after an instance patch)."""
    for swap in spec.swaps:
        if isinstance(swap, MethodSwap) and options[swap.option]:
            register(load_object(swap.replacement))


def bind(func, instance):
    """At load: ``func`` bound to ``instance`` again; registering it lets a fresh process pickle the model too."""
    register(func)
    return MethodType(func, instance)


def _reduce_method(method: MethodType):
    if method.__func__ in _ORIGINAL_KEYS:
        return bind_original, (*_ORIGINAL_KEYS[method.__func__], method.__self__)
    if method.__func__ in _REPLACEMENTS:
        return bind, (method.__func__, method.__self__)
    if _previous_reducer is not None:
        return _previous_reducer(method)
    return method.__reduce__()
