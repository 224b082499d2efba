# make demo | test | test-convergence | checkstyle | bench
# Each target creates (or reuses) the virtual environment in $(VENV) and installs what it needs.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_CPU := torch==2.13.0
REQUIREMENTS ?= requirements/ci.txt
STAMP := $(VENV)/.installed-$(notdir $(REQUIREMENTS))
PYTEST_FLAGS ?= -q -p no:cacheprovider

.PHONY: demo test test-convergence checkstyle format bench setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml $(REQUIREMENTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# A CUDA torch already present is kept; otherwise the CPU build, pinned (an unpinned torch pulls CUDA).
	$(PY) -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null || \
		$(PY) -m pip install -q $(TORCH_CPU)
	$(PY) -m pip install -q -r $(REQUIREMENTS)
	$(PY) -m pip install -q --no-deps -e .
	touch $@

demo: $(STAMP)
	$(PY) -m liger_dspine.cli demo

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_FLAGS) test/transformers

test-convergence: $(STAMP)
	$(PY) -m pytest $(PYTEST_FLAGS) test/convergence

checkstyle: $(STAMP)
	$(PY) -m ruff check src test benchmark
	$(PY) -m ruff format --check src test benchmark

format: $(STAMP)
	$(PY) -m ruff check --fix src test benchmark
	$(PY) -m ruff format src test benchmark

# GPU only: see benchmark/run_gpu.sh for the full run (CUDA tests, bf16 convergence, benchmark).
bench: $(STAMP)
	$(PY) benchmark/bench_deepseek_v3.py --suite quick

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
