"""transformers' own model tests with and without liger-dspine's class-level patch.

Given a transformers source tree (its ``tests/`` holding ``test_modeling_common.py`` and
``tests/models/<type>/test_modeling_<type>.py``), each model type's test file is run with pytest twice, in a
process of its own: natively, then with the class-level patch applied by a pytest plugin this script writes
(``liger_dspine.apply_liger_kernel(model_type)`` in ``pytest_configure``, before the tests are collected). The
transformers that runs is the installed one, so take the tree of the installed version. On a machine without CUDA the
Triton kernels run through Triton's CPU interpreter (``LIGER_DSPINE_INTERPRET=1``, set for both runs unless given).

Prints one row per model type: tests passed natively, passed patched (each out of the tests run), and how many
passed natively but failed or errored patched; their node ids go to ``<out-dir>/<model>_regressions.txt`` and each
run's JUnit XML and log to ``<out-dir>/<model>_{native,patched}.xml|.log``.

    python benchmark/transformers_model_tests.py --tree ~/src/transformers --models deepseek_v3
    python benchmark/transformers_model_tests.py --tree ~/src/transformers --pytest-args "-k moe"
    python benchmark/transformers_model_tests.py --tree ~/src/transformers --jobs 8 --timeout 240   # on a GPU
"""

import argparse
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

PLUGIN_NAME = "liger_dspine_class_patch"
PLUGIN = '''"""Written by benchmark/transformers_model_tests.py: the class-level patch, before tests are collected."""

import os


def pytest_configure(config):
    import liger_dspine

    liger_dspine.apply_liger_kernel(os.environ["LIGER_DSPINE_TEST_MODEL_TYPE"])
'''
PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"


@dataclass
class RunResult:
    outcomes: dict[str, str]  # test node id -> passed / failed / skipped (errors count as failed)
    returncode: int

    def count(self, outcome: str) -> int:
        return sum(value == outcome for value in self.outcomes.values())

    @property
    def run(self) -> int:
        """Tests that ran (not skipped)."""
        return len(self.outcomes) - self.count(SKIPPED)

    def summary(self) -> str:
        if not self.outcomes:
            return f"no tests (exit {self.returncode})"
        return f"{self.count(PASSED)}/{self.run}"


def parse_junit(path: Path, tree: Path) -> dict[str, str]:
    """Test node id (``tests/.../test_x.py::Class::test``) -> outcome, from pytest's JUnit XML; an error or a failure
    is "failed". The XML names a test by its dotted ``classname`` (module path, then classes): the module part is the
    longest prefix that is a file of ``tree``."""
    if not path.exists():
        return {}
    outcomes = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        if not case.get("name"):  # an interrupted run's entry for the interruption itself
            continue
        node = "::".join(
            part for part in (*_file_and_classes(case.get("classname", ""), tree), case.get("name")) if part
        )
        tags = {child.tag for child in case}
        if tags & {"failure", "error"}:
            outcomes[node] = FAILED
        elif "skipped" in tags:
            outcomes[node] = SKIPPED
        else:
            outcomes[node] = PASSED
    return outcomes


def _file_and_classes(classname: str, tree: Path) -> list[str]:
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        file = "/".join(parts[:end]) + ".py"
        if (tree / file).is_file():
            return [file, *parts[end:]]
    return [classname]


def regressions(native: RunResult, patched: RunResult) -> list[str]:
    """Tests that passed natively and failed (or errored) patched."""
    return sorted(
        name for name, outcome in native.outcomes.items() if outcome == PASSED and patched.outcomes.get(name) == FAILED
    )


def test_file(tree: Path, model_type: str) -> Path:
    return tree / "tests" / "models" / model_type / f"test_modeling_{model_type}.py"


def check_tree(tree: Path) -> None:
    if not (tree / "tests" / "test_modeling_common.py").is_file():
        raise SystemExit(
            f"liger-dspine: {tree} is not a transformers source tree: tests/test_modeling_common.py is missing"
        )
    if not (tree / "tests" / "models").is_dir():
        raise SystemExit(f"liger-dspine: {tree}/tests has no models/ folder (a PyPI sdist ships the common tests only)")


def model_types_of(tree: Path, requested: list[str] | None) -> list[str]:
    """The requested model types (each must have a test file), else every registered one the tree has tests for."""
    from liger_dspine.registry import MODEL_TYPE_TO_APPLY_LIGER_FN

    if requested:
        unknown = [m for m in requested if m not in MODEL_TYPE_TO_APPLY_LIGER_FN]
        if unknown:
            raise SystemExit(f"liger-dspine: no patch for model type(s) {', '.join(unknown)}")
        missing = [m for m in requested if not test_file(tree, m).is_file()]
        if missing:
            raise SystemExit(f"liger-dspine: {tree} has no test file for {', '.join(missing)}")
        return requested
    return sorted(m for m in MODEL_TYPE_TO_APPLY_LIGER_FN if test_file(tree, m).is_file())


def run_pytest(tree: Path, model_type: str, patched: bool, out_dir: Path, plugin_dir: Path, args) -> RunResult:
    """One pytest process over the model type's test file, in the tree (its rootdir and conftest)."""
    kind = "patched" if patched else "native"
    junit = out_dir / f"{model_type}_{kind}.xml"
    junit.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pytest", str(test_file(tree, model_type)), "-q", "-p", "no:cacheprovider"]
    command += ["--junitxml", str(junit), *shlex.split(args.pytest_args)]
    env = dict(os.environ)
    if "LIGER_DSPINE_INTERPRET" not in env and not cuda_available():
        env["LIGER_DSPINE_INTERPRET"] = "1"  # Triton's CPU interpreter
    if patched:
        command += ["-p", PLUGIN_NAME]
        env["LIGER_DSPINE_TEST_MODEL_TYPE"] = model_type
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(plugin_dir), env.get("PYTHONPATH")]))
    with open(out_dir / f"{model_type}_{kind}.log", "w") as log:
        process = subprocess.Popen(
            command, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_default_sigint
        )
        try:
            returncode = process.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            returncode = _interrupt(process)
            log.write(f"\nliger-dspine: interrupted after {args.timeout} s; the tests that finished are counted\n")
    return RunResult(parse_junit(junit, tree), returncode)


def _default_sigint():
    """A background shell starts its jobs with SIGINT ignored; pytest needs it to stop cleanly."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt(process: subprocess.Popen) -> int:
    """Ctrl-C the pytest run, so that it still writes its JUnit XML for the tests that finished; kill it if it
    does not stop within a minute."""
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    return -1


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def format_table(rows: list[tuple[str, RunResult, RunResult]]) -> str:
    header = ("model", "native pass", "patched pass", "native pass, patched fail")
    lines = [header] + [(model, n.summary(), p.summary(), str(len(regressions(n, p)))) for model, n, p in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(line, widths)) + " |" for line in lines]
    text.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, required=True, help="transformers source tree (with tests/models/)")
    parser.add_argument("--models", help="comma-separated model types (default: every registered one with tests)")
    parser.add_argument("--out-dir", type=Path, default=Path("transformers_model_tests"))
    parser.add_argument("--pytest-args", default="", help='extra pytest arguments, e.g. "-k moe"')
    parser.add_argument(
        "--timeout", type=float, default=None, help="seconds per pytest run; past it, the tests that finished count"
    )
    parser.add_argument("--jobs", type=int, default=1, help="pytest runs at once (natively and patched: two a model)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        raise SystemExit(f"liger-dspine: --jobs must be at least 1, got {args.jobs}")

    tree = args.tree.resolve()
    check_tree(tree)
    models = model_types_of(tree, args.models.split(",") if args.models else None)
    if not models:
        raise SystemExit(f"liger-dspine: {tree}/tests/models has no test file of a patched model type")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out_dir = args.out_dir.resolve()
    rows = []
    with tempfile.TemporaryDirectory() as plugin_dir:
        (Path(plugin_dir) / f"{PLUGIN_NAME}.py").write_text(PLUGIN)

        def run(job: tuple[str, bool]) -> RunResult:
            model, patched = job
            return run_pytest(tree, model, patched, out_dir, Path(plugin_dir), args)

        jobs = [(model, patched) for model in models for patched in (False, True)]
        with ThreadPoolExecutor(args.jobs) as pool:
            results = dict(zip(jobs, pool.map(run, jobs)))
        for model in models:
            native, patched = results[model, False], results[model, True]
            (out_dir / f"{model}_regressions.txt").write_text("".join(f"{n}\n" for n in regressions(native, patched)))
            rows.append((model, native, patched))
            print(format_table(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(format_table(rows))
    print(f"\nnode ids of the tests passing natively and failing patched: {out_dir}/<model>_regressions.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
