"""The options an ``apply_liger_kernel_to_<model>`` function is called with, checked before anything is patched: a
name it does not take is a ``TypeError`` listing the ones it takes, and a switch (annotated ``bool``) must be True or
False (or None where ``bool | None``), so that a string such as ``"false"`` never turns a swap on by being truthy."""

import functools
import inspect

from liger_dspine.patching import check_options

_SWITCH = (bool, "bool")
_OPTIONAL_SWITCH = (bool | None, "bool | None")


def checked_options(fn):
    """Wrap an apply function so that its options are checked first; its signature stays visible to
    ``inspect.signature`` (liger-kernel's dispatch filters the options it passes by it)."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def apply(*args, **options):
        check_options(fn, options)
        for name, value in signature.bind(*args, **options).arguments.items():
            annotation = signature.parameters[name].annotation
            optional = annotation in _OPTIONAL_SWITCH
            if (annotation in _SWITCH or optional) and not (_is_switch(value) or (optional and value is None)):
                allowed = "True, False or None" if optional else "True or False"
                raise TypeError(f"liger-dspine: {fn.__name__}() option {name} must be {allowed}, got {value!r}")
        return fn(*args, **options)

    return apply


def _is_switch(value) -> bool:
    """A bool, or 0 / 1 as an int or a NumPy bool (what a parsed config may hold)."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return True
    return isinstance(value, int) and value in (0, 1)
