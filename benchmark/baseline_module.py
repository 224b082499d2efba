"""Another version of one of the package's op modules, loaded beside the installed one for a side-by-side benchmark."""

import os
import types


def load_baseline(path: str, name: str) -> types.ModuleType:
    """The module in file ``path``, its custom ops registered under the namespace liger_dspine_baseline (the names of
    this version's ops are taken)."""
    with open(path) as handle:
        source = handle.read().replace('"liger_dspine::', '"liger_dspine_baseline::')
    module = types.ModuleType(name)
    module.__file__ = os.path.abspath(path)
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module
