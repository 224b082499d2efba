# make demo | test | test-slow | test-convergence | test-matrix | checkstyle | docs | bench
# Each target creates (or reuses) the virtual environment in $(VENV) and installs what it needs.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch and triton when no CUDA torch is present: the CPU build (PyPI's plain torch==2.13.0 is the CUDA build, GBs of
# wheels) and the triton CI tests. A CUDA torch pins its own triton (2.13.0: 3.7.1; 2.11.0: 3.6.0) and is kept.
TORCH_PIN ?= torch==2.13.0+cpu
TRITON_PIN ?= triton==3.9.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
REQUIREMENTS ?= requirements/ci.txt
STAMP := $(VENV)/.installed-$(notdir $(REQUIREMENTS))
PYTEST_FLAGS ?= -q -p no:cacheprovider
# Tests run in two worker processes, each test file in one of them: a process keeps about one core busy (the Triton
# interpreter is Python), so two halve the wall time on two cores. PYTEST_WORKERS=0 runs them in this process.
PYTEST_WORKERS ?= 2
PYTEST_PARALLEL = $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile)

MATRIX_VERSIONS ?= 5.8.1 5.17 5.24

.PHONY: demo test test-slow test-fast test-matrix test-gpu-stack test-convergence checkstyle docs format bench setup \
	clean

setup: $(STAMP)

$(STAMP): pyproject.toml $(REQUIREMENTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# A CUDA torch already present is kept with its triton. Otherwise $(TORCH_PIN) and $(TRITON_PIN): first from
	@# pip's own sources (this machine's CI finds the torch 2.13.0 CPU wheel in pip's find-links), else from the CPU index.
	$(PY) -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null || \
		$(PY) -m pip install -q $(TORCH_PIN) $(TRITON_PIN) 2>/dev/null || \
		$(PY) -m pip install -q --extra-index-url $(TORCH_CPU_INDEX) $(TORCH_PIN) $(TRITON_PIN)
	$(PY) -m pip install -q -r $(REQUIREMENTS)
	$(PY) -m pip install -q --no-deps -e .
	touch $@

demo: $(STAMP)
	$(PY) -m liger_dspine.cli demo

# The unit and parity tests but those marked `slow` (their time: README.md, "Two commands").
test: $(STAMP)
	$(PY) -m pytest $(PYTEST_FLAGS) $(PYTEST_PARALLEL) -m "not slow" test/transformers

# The tests marked `slow`: the longest ones on the CPU interpreter.
test-slow: $(STAMP)
	$(PY) -m pytest $(PYTEST_FLAGS) $(PYTEST_PARALLEL) -m slow test/transformers

# The tests marked `matrix` (those that use transformers' model classes), in this environment.
MATRIX_MARKER ?= matrix
test-fast: $(STAMP)
	$(PY) -m pytest $(PYTEST_FLAGS) $(PYTEST_PARALLEL) -m "$(MATRIX_MARKER)" test/transformers

# The tests marked `matrix` against other transformers versions, each in its own environment (.venv-<version>); the
# slow ones among them (whole-model training runs) run with the pinned version only, in test-slow.
test-matrix:
	set -e; for v in $(MATRIX_VERSIONS); do \
		$(MAKE) test-fast VENV=.venv-$$v REQUIREMENTS=requirements/transformers-$$v.txt MATRIX_MARKER="matrix and not slow"; \
	done

# The whole suite with the GPU machine's torch, triton and transformers, on CPU through Triton 3.6's interpreter.
# Not in CI: PyPI's torch 2.11 is a CUDA build, about 4 GB of downloads on a new machine.
test-gpu-stack:
	$(MAKE) test test-slow VENV=.venv-gpu-stack REQUIREMENTS=requirements/gpu-stack.txt TORCH_PIN=torch==2.11.0 \
		TRITON_PIN=triton==3.6.0

test-convergence: $(STAMP)
	$(PY) -m pytest $(PYTEST_FLAGS) $(PYTEST_PARALLEL) test/convergence

checkstyle: $(STAMP)
	$(PY) -m ruff check src test benchmark
	$(PY) -m ruff format --check src test benchmark README.md docs

# The documentation site (mkdocs.yml, docs/): a broken link, page or nav entry fails the build.
docs: $(STAMP)
	$(PY) -m mkdocs build --strict --quiet --site-dir build/site

format: $(STAMP)
	$(PY) -m ruff check --fix src test benchmark
	$(PY) -m ruff format src test benchmark README.md docs

# GPU only: see benchmark/run_gpu.sh for the full run (CUDA tests, bf16 convergence, benchmark).
bench: $(STAMP)
	$(PY) benchmark/bench_deepseek_v3.py --suite quick

clean:
	rm -rf $(VENV) .venv-* .pytest_cache .ruff_cache build/site
