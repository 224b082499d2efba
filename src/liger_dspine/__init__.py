"""liger-dspine: Liger kernels for DeepSeek-V3, the models built from its classes, and DSpine drafters, as a plugin
for liger-kernel.

Importing this package imports neither transformers nor liger-kernel nor any Triton kernel, and sets no environment
variable: they load when a patch is applied. Set ``LIGER_DSPINE_INTERPRET=1`` before import to run the kernels on a
CPU through Triton's interpreter (tests, demos).
"""

from liger_dspine._interpreter import enable_cpu_interpreter
from liger_dspine._interpreter import enable_from_environment as _enable_from_environment

_enable_from_environment()

from liger_dspine.auto_model import AutoLigerDSpineForCausalLM  # noqa: E402
from liger_dspine.models.axk1.apply import apply_liger_kernel_to_axk1  # noqa: E402
from liger_dspine.models.axk1.apply import revert_liger_kernel_to_axk1  # noqa: E402
from liger_dspine.models.deepseek_v2.apply import apply_liger_kernel_to_deepseek_v2  # noqa: E402
from liger_dspine.models.deepseek_v2.apply import revert_liger_kernel_to_deepseek_v2  # noqa: E402
from liger_dspine.models.deepseek_v3.apply import apply_liger_kernel_to_deepseek_v3  # noqa: E402
from liger_dspine.models.deepseek_v3.apply import revert_liger_kernel_to_deepseek_v3  # noqa: E402
from liger_dspine.models.deepseek_v4.apply import apply_liger_kernel_to_deepseek_v4  # noqa: E402
from liger_dspine.models.deepseek_v4.apply import revert_liger_kernel_to_deepseek_v4  # noqa: E402
from liger_dspine.models.deepseek_v32.apply import apply_liger_kernel_to_deepseek_v32  # noqa: E402
from liger_dspine.models.deepseek_v32.apply import revert_liger_kernel_to_deepseek_v32  # noqa: E402
from liger_dspine.models.dots1.apply import apply_liger_kernel_to_dots1  # noqa: E402
from liger_dspine.models.dots1.apply import revert_liger_kernel_to_dots1  # noqa: E402
from liger_dspine.models.dspine.apply import apply_liger_kernel_to_dspine  # noqa: E402
from liger_dspine.models.dspine.apply import revert_liger_kernel_to_dspine  # noqa: E402
from liger_dspine.models.ergo.apply import apply_liger_kernel_to_ergo  # noqa: E402
from liger_dspine.models.ergo.apply import revert_liger_kernel_to_ergo  # noqa: E402
from liger_dspine.models.glm4_moe.apply import apply_liger_kernel_to_glm4_moe  # noqa: E402
from liger_dspine.models.glm4_moe.apply import revert_liger_kernel_to_glm4_moe  # noqa: E402
from liger_dspine.models.glm4_moe_lite.apply import apply_liger_kernel_to_glm4_moe_lite  # noqa: E402
from liger_dspine.models.glm4_moe_lite.apply import revert_liger_kernel_to_glm4_moe_lite  # noqa: E402
from liger_dspine.models.glm_moe_dsa.apply import apply_liger_kernel_to_glm_moe_dsa  # noqa: E402
from liger_dspine.models.glm_moe_dsa.apply import revert_liger_kernel_to_glm_moe_dsa  # noqa: E402
from liger_dspine.models.kimi_k25.apply import apply_liger_kernel_to_kimi_k25  # noqa: E402
from liger_dspine.models.kimi_k25.apply import revert_liger_kernel_to_kimi_k25  # noqa: E402
from liger_dspine.models.minicpm3.apply import apply_liger_kernel_to_minicpm3  # noqa: E402
from liger_dspine.models.minicpm3.apply import revert_liger_kernel_to_minicpm3  # noqa: E402
from liger_dspine.models.minicpm5_moe.apply import apply_liger_kernel_to_minicpm5_moe  # noqa: E402
from liger_dspine.models.minicpm5_moe.apply import revert_liger_kernel_to_minicpm5_moe  # noqa: E402
from liger_dspine.models.mistral3.apply import apply_liger_kernel_to_mistral3  # noqa: E402
from liger_dspine.models.mistral3.apply import revert_liger_kernel_to_mistral3  # noqa: E402
from liger_dspine.models.mistral4.apply import apply_liger_kernel_to_mistral4  # noqa: E402
from liger_dspine.models.mistral4.apply import revert_liger_kernel_to_mistral4  # noqa: E402
from liger_dspine.models.param2moe.apply import apply_liger_kernel_to_param2moe  # noqa: E402
from liger_dspine.models.param2moe.apply import revert_liger_kernel_to_param2moe  # noqa: E402
from liger_dspine.models.youtu.apply import apply_liger_kernel_to_youtu  # noqa: E402
from liger_dspine.models.youtu.apply import revert_liger_kernel_to_youtu  # noqa: E402
from liger_dspine.patching import PatchReport  # noqa: E402
from liger_dspine.registry import MODEL_TYPE_TO_APPLY_LIGER_FN  # noqa: E402
from liger_dspine.registry import apply_liger_kernel  # noqa: E402
from liger_dspine.registry import apply_liger_kernel_to_instance  # noqa: E402
from liger_dspine.registry import register_with_liger  # noqa: E402

__all__ = [
    "AutoLigerDSpineForCausalLM",
    "MODEL_TYPE_TO_APPLY_LIGER_FN",
    "PatchReport",
    "apply_liger_kernel",
    "apply_liger_kernel_to_axk1",
    "apply_liger_kernel_to_deepseek_v2",
    "apply_liger_kernel_to_deepseek_v3",
    "apply_liger_kernel_to_deepseek_v32",
    "apply_liger_kernel_to_deepseek_v4",
    "apply_liger_kernel_to_dots1",
    "apply_liger_kernel_to_dspine",
    "apply_liger_kernel_to_ergo",
    "apply_liger_kernel_to_glm4_moe",
    "apply_liger_kernel_to_glm4_moe_lite",
    "apply_liger_kernel_to_glm_moe_dsa",
    "apply_liger_kernel_to_instance",
    "apply_liger_kernel_to_kimi_k25",
    "apply_liger_kernel_to_mistral3",
    "apply_liger_kernel_to_minicpm3",
    "apply_liger_kernel_to_minicpm5_moe",
    "apply_liger_kernel_to_mistral4",
    "apply_liger_kernel_to_param2moe",
    "apply_liger_kernel_to_youtu",
    "enable_cpu_interpreter",
    "register_with_liger",
    "revert_liger_kernel_to_axk1",
    "revert_liger_kernel_to_deepseek_v2",
    "revert_liger_kernel_to_deepseek_v3",
    "revert_liger_kernel_to_deepseek_v32",
    "revert_liger_kernel_to_deepseek_v4",
    "revert_liger_kernel_to_dots1",
    "revert_liger_kernel_to_dspine",
    "revert_liger_kernel_to_ergo",
    "revert_liger_kernel_to_glm4_moe",
    "revert_liger_kernel_to_glm4_moe_lite",
    "revert_liger_kernel_to_glm_moe_dsa",
    "revert_liger_kernel_to_kimi_k25",
    "revert_liger_kernel_to_mistral3",
    "revert_liger_kernel_to_minicpm3",
    "revert_liger_kernel_to_minicpm5_moe",
    "revert_liger_kernel_to_mistral4",
    "revert_liger_kernel_to_param2moe",
    "revert_liger_kernel_to_youtu",
]
