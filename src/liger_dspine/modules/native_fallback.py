"""SwiGLU MLPs and experts that stay native where the Liger kernel would not compute them (an activation other than
SiLU, as in transformers' tiny test configs).

On an instance patch the engine leaves such a module as it is (the replacement's ``kept_native_reason``). At class
level the Liger class stands in the modeling module, so the model's own code builds it: ``native_instead`` then
builds the native class it replaced, with transformers' ``__init__``, and gives it a class derived from both, the
native one first. The module computes, initialises and loads as transformers' own (its forward and methods are the
native ones), and ``isinstance`` holds for either class: the patched modeling module's ``_init_weights`` looks for
the Liger class. A warning says so, once per class and reason.
"""

from torch import nn

from liger_dspine import patching
from liger_dspine.modules.config_reading import unfused_activation_reason

_KEPT_CLASSES: dict[tuple[type, type], type] = {}


def native_instead(liger_class: type, args: tuple, kwargs: dict) -> nn.Module | None:
    """The native module a class-level swap replaced by ``liger_class``, built from the same arguments, where the
    config's activation is not one the kernel fuses; None otherwise (the Liger module is built)."""
    config = args[0] if args else kwargs.get("config")
    reason = None if config is None else unfused_activation_reason(config)
    if reason is None:
        return None
    native = patching.replaced_native_class(liger_class)
    if native is None:
        return None  # built outside a patched modeling module: the Liger __init__ refuses the activation
    module = native(*args, **kwargs)
    module.__class__ = kept_native_class(liger_class, native)
    patching.warn_kept_native(f"{native.__name__} (for {liger_class.__name__})", reason)
    return module


def kept_native_class(liger_class: type, native: type) -> type:
    """The class of a native module built where ``liger_class`` was asked for: ``native`` first, then
    ``liger_class``; one per pair."""
    kept = _KEPT_CLASSES.get((liger_class, native))
    if kept is None:
        kept = type(
            native.__name__,
            (native, liger_class),
            {
                "__init__": _built_already,
                "__module__": __name__,
                "__qualname__": f"{native.__qualname__}_kept_for_{liger_class.__qualname__}",
                "__reduce_ex__": _reduce_kept,
                "__doc__": native.__doc__,
            },
        )
        _KEPT_CLASSES[(liger_class, native)] = kept
    return kept


def _built_already(self, *args, **kwargs) -> None:
    """The native ``__init__`` ran in ``native_instead``; Python calls this one after ``__new__``."""


def _reduce_kept(self, protocol):
    """Pickled (and deep-copied) by the two class names, the native one looked up as transformers defines it."""
    native, liger_class = type(self).__bases__
    liger_path = f"{liger_class.__module__}:{liger_class.__qualname__}"
    return _rebuild_kept, (liger_path, native.__module__, native.__name__), self.__dict__.copy()


def _rebuild_kept(liger_path: str, native_module: str, native_name: str) -> nn.Module:
    native = patching.original_global(native_module, native_name)
    kept = kept_native_class(patching.load_object(liger_path), native)
    return kept.__new__(kept)
