"""Liger replacements for transformers modules, shared by every model spec.

Each class is built with the same arguments as the module it replaces (class-level patch) and has a ``convert``
classmethod that turns an existing native module into it in place (instance patch), keeping its parameters.
"""
