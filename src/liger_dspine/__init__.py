"""liger-dspine: Liger kernels for DeepSeek-V3 and DSpine drafters, as a plugin for liger-kernel."""

from liger_dspine._interpreter import enable_cpu_interpreter
from liger_dspine._interpreter import enable_from_environment as _enable_from_environment

_enable_from_environment()

__all__ = ["enable_cpu_interpreter"]
