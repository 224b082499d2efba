"""What ``import liger_dspine`` and the fused-experts patch change in a process, each in a fresh interpreter.

The CPU interpreter mode is off in these subprocesses (it sets ``LIGER_FUSED_MOE_AUTOTUNE=0`` by its own need); no
kernel runs, only modules are imported.
"""

import json
import os
import subprocess
import sys

import pytest

AUTOTUNE = "LIGER_FUSED_MOE_AUTOTUNE"


def run_python(code: str, **env_overrides) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON object as its last line."""
    env = {k: v for k, v in os.environ.items() if k not in ("LIGER_DSPINE_INTERPRET", "TRITON_INTERPRET", AUTOTUNE)}
    env.update(env_overrides)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


STATE = """
import json, os, sys
def state(**extra):
    kernels = sys.modules.get("liger_kernel.ops.fused_moe_kernels")
    return dict(
        autotune=os.environ.get("LIGER_FUSED_MOE_AUTOTUNE"),
        transformers="transformers" in sys.modules,
        liger_kernel="liger_kernel" in sys.modules,
        triton="triton" in sys.modules,
        autotune_disabled=None if kernels is None else kernels._AUTOTUNE_DISABLED,
        **extra,
    )
"""


def test_import_loads_no_transformers_and_sets_no_variable():
    result = run_python(STATE + "import liger_dspine\nprint(json.dumps(state()))")
    assert result == dict(autotune=None, transformers=False, liger_kernel=False, triton=False, autotune_disabled=None)


def test_a_patch_without_fused_experts_leaves_the_autotuner_alone():
    code = STATE + (
        "import liger_dspine\n"
        "liger_dspine.apply_liger_kernel_to_deepseek_v3()\n"
        "liger_dspine.revert_liger_kernel_to_deepseek_v3()\n"
        "print(json.dumps(state()))"
    )
    result = run_python(code)
    assert result["autotune"] is None and result["autotune_disabled"] is False


@pytest.mark.parametrize("explicit, disabled", [(None, True), ("1", False), ("0", True)])
def test_a_fused_experts_patch_turns_autotuning_off_unless_set(explicit, disabled):
    code = STATE + (
        "import liger_dspine\n"
        "liger_dspine.apply_liger_kernel_to_deepseek_v3(fused_experts=True)\n"
        "liger_dspine.revert_liger_kernel_to_deepseek_v3()\n"
        "print(json.dumps(state()))"
    )
    result = run_python(code, **({} if explicit is None else {AUTOTUNE: explicit}))
    assert result["autotune"] == ("0" if explicit is None else explicit)
    assert result["autotune_disabled"] is disabled


def test_a_fused_experts_patch_after_liger_kernel_autotuning_was_fixed_warns():
    code = STATE + (
        "import logging\n"
        "import liger_kernel.ops  # imports the fused-MoE kernels with autotuning on\n"
        "import liger_dspine\n"
        "records = []\n"
        "handler = logging.Handler()\n"
        "handler.emit = records.append\n"
        "logging.getLogger('liger_dspine').addHandler(handler)\n"
        "liger_dspine.apply_liger_kernel_to_deepseek_v3(fused_experts=True)\n"
        "liger_dspine.revert_liger_kernel_to_deepseek_v3()\n"
        "print(json.dumps(state(warnings=[r.getMessage() for r in records if r.levelname == 'WARNING'])))"
    )
    result = run_python(code)
    assert result["autotune"] is None and result["autotune_disabled"] is False
    assert len(result["warnings"]) == 1 and AUTOTUNE in result["warnings"][0]
