"""``benchmark/transformers_model_tests.py`` on a fake transformers tree: a test file for deepseek_v3 whose tests
read whether the class-level patch is in place, run natively and patched; the table, the regressions file, the
JUnit parsing and the refusals of a tree or model type it cannot run."""

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).resolve().parents[3] / "benchmark"
SCRIPT = BENCHMARK / "transformers_model_tests.py"
sys.path.insert(0, str(BENCHMARK))

import transformers_model_tests as script  # noqa: E402

TEST_FILE = "tests/models/deepseek_v3/test_modeling_deepseek_v3.py"
MODEL_TEST = """
import unittest

from transformers.models.deepseek_v3 import modeling_deepseek_v3 as modeling

from ...test_modeling_common import CommonTesterMixin


def patched():
    return modeling.DeepseekV3RMSNorm.__module__.startswith("liger_dspine")


class DeepseekV3ModelTest(CommonTesterMixin, unittest.TestCase):
    def test_always(self):
        self.assertEqual(1, 1)

    def test_native_only(self):
        self.assertFalse(patched())

    def test_patched_only(self):
        self.assertTrue(patched())

    @unittest.skip("not here")
    def test_skipped(self):
        pass


def test_function_native_only():
    assert not patched()
"""
COMMON = """
class CommonTesterMixin:
    def test_common(self):
        assert True
"""


def fake_tree(root: Path, with_models: bool = True) -> Path:
    files = {"tests/__init__.py": "", "tests/test_modeling_common.py": COMMON}
    if with_models:
        files.update(
            {"tests/models/__init__.py": "", "tests/models/deepseek_v3/__init__.py": "", TEST_FILE: MODEL_TEST}
        )
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))
    return root


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # two pytest runs in subprocesses: make test-slow
def test_native_and_patched_runs_of_a_fake_tree(tmp_path):
    tree = fake_tree(tmp_path / "transformers")
    out = tmp_path / "out"
    done = run("--tree", str(tree), "--models", "deepseek_v3", "--out-dir", str(out))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    table = done.stdout.split("\n\n")[1].splitlines()
    assert table[0].split("|")[1:-1] == [
        " model       ",
        " native pass ",
        " patched pass ",
        " native pass, patched fail ",
    ]
    assert [cell.strip() for cell in table[2].split("|")[1:-1]] == ["deepseek_v3", "4/5", "3/5", "2"]
    assert (out / "deepseek_v3_regressions.txt").read_text().splitlines() == [
        f"{TEST_FILE}::DeepseekV3ModelTest::test_native_only",
        f"{TEST_FILE}::test_function_native_only",
    ]
    native = script.parse_junit(out / "deepseek_v3_native.xml", tree)
    assert native[f"{TEST_FILE}::DeepseekV3ModelTest::test_common"] == script.PASSED  # inherited from the mixin
    assert native[f"{TEST_FILE}::DeepseekV3ModelTest::test_skipped"] == script.SKIPPED
    assert native[f"{TEST_FILE}::DeepseekV3ModelTest::test_patched_only"] == script.FAILED


def test_junit_errors_count_as_failures(tmp_path):
    tree = fake_tree(tmp_path)
    xml = tmp_path / "run.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.models.deepseek_v3.test_modeling_deepseek_v3.DeepseekV3ModelTest" name="test_a">'
        '<error message="setup"/></testcase>'
        '<testcase classname="tests.models.deepseek_v3.test_modeling_deepseek_v3" name="test_b[1]"/>'
        '<testcase classname="not.a.file" name="test_c"><failure message="x"/></testcase>'
        "</testsuite></testsuites>"
    )
    assert script.parse_junit(xml, tree) == {
        f"{TEST_FILE}::DeepseekV3ModelTest::test_a": script.FAILED,
        f"{TEST_FILE}::test_b[1]": script.PASSED,
        "not.a.file::test_c": script.FAILED,
    }
    native = script.RunResult({"a": script.PASSED, "b": script.PASSED, "c": script.SKIPPED}, 0)
    patched = script.RunResult({"a": script.FAILED, "b": script.PASSED}, 1)
    assert script.regressions(native, patched) == ["a"]
    assert (native.summary(), patched.summary(), script.RunResult({}, 4).summary()) == (
        "2/2",
        "1/2",
        "no tests (exit 4)",
    )


@pytest.mark.parametrize(
    "with_models,models,message",
    [
        (False, "deepseek_v3", "has no models/ folder (a PyPI sdist ships the common tests only)"),
        (True, "llama", "liger-dspine: no patch for model type(s) llama"),
        (True, "deepseek_v2", "has no test file for deepseek_v2"),
    ],
)
def test_what_it_cannot_run_is_named(tmp_path, with_models, models, message):
    tree = fake_tree(tmp_path, with_models)
    with pytest.raises(SystemExit, match=re.escape(message)):
        script.main(["--tree", str(tree), "--models", models, "--out-dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_a_folder_without_tests_is_not_a_tree(tmp_path):
    message = f"liger-dspine: {tmp_path} is not a transformers source tree: tests/test_modeling_common.py is missing"
    with pytest.raises(SystemExit, match=re.escape(message)):
        script.main(["--tree", str(tmp_path), "--out-dir", str(tmp_path / "out")])


SLOW_TEST = """
import time


def test_a_fast():
    assert True


def test_b_slow():
    time.sleep(120)
"""


def test_a_run_past_the_timeout_counts_the_tests_that_finished(tmp_path):
    tree = fake_tree(tmp_path / "transformers")
    (tree / TEST_FILE).write_text(SLOW_TEST)
    out = tmp_path / "out"
    out.mkdir()
    args = script.argparse.Namespace(pytest_args="", timeout=20)
    result = script.run_pytest(tree, "deepseek_v3", False, out, tmp_path, args)
    assert result.returncode == -1
    assert result.outcomes == {f"{TEST_FILE}::test_a_fast": script.PASSED}  # the interrupted test is not counted
    assert "interrupted after 20 s" in (out / "deepseek_v3_native.log").read_text()
