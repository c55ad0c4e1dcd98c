# `make test` and `make demo` bootstrap their own virtual environment.
# The pinned CPU torch goes in first: an unpinned `torch` would pull a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0

.PHONY: test demo lint format venv clean compat docs gpu-check-cpu

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

# two workers, a test file per worker at a time (three measured no faster on a fresh clone)
test: $(VENV)/.installed
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile --durations=10 tests

# benchmarks/gpu_check.py's whole path on the CPU with small models (CI runs it so that the GPU
# check is ready whenever a GPU is at hand); writes $(TMPDIR)/gpu_check-cpu.{json,md}, records nothing
gpu-check-cpu: $(VENV)/.installed
	OMP_NUM_THREADS=1 $(PY) -m benchmarks.gpu_check --device cpu --steps 3 --rounds 2 --no-record \
		--out $(or $(TMPDIR),/tmp)/gpu_check

# ruff, configured in pyproject.toml: lint rules and the formatter's check (`make format` fixes)
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(VENV)/.installed
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# docs/measurements.md and README's status figures, rewritten from benchmarks/results/*.jsonl
docs: $(VENV)/.installed
	$(PY) -m benchmarks.render

# Plans 2 layers of LLaMA-3-8B on a fake (2, 4) mesh with its parameter placements, then all
# 32 layers on a fake (8, 8) mesh with the `autoparallel` command, writing plan.html.
demo: $(VENV)/.installed
	$(PY) examples/plan_llama.py
	$(VENV)/bin/autoparallel plan --model llama3-8b --mesh 8x8 --mesh-names dp,tp \
		--batch 8 --seq 2048 --layers 32 --html plan.html

# The suite on another torch release, in its own venv: `make compat TORCH=2.14.1` (where pip is
# configured to cap torch lower: `PIP_CONSTRAINT=/dev/null make compat TORCH=2.15.0`). Run by hand,
# not in CI: it installs that release's full wheel (several GB).
TORCH ?=
COMPAT_VENV := .venv-torch-$(TORCH)

$(COMPAT_VENV)/.installed: pyproject.toml
	test -n "$(TORCH)" || { echo 'usage: make compat TORCH=<version>'; exit 2; }
	test -x $(COMPAT_VENV)/bin/python || $(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install -q --upgrade pip
	$(COMPAT_VENV)/bin/python -m pip install -q torch==$(TORCH)
	$(COMPAT_VENV)/bin/python -m pip install -q -e '.[dev]'
	touch $@

compat: $(COMPAT_VENV)/.installed
	OMP_NUM_THREADS=1 $(COMPAT_VENV)/bin/python -m pytest -q -n 2 --dist loadfile --durations=10 tests

clean:
	rm -rf $(VENV) .venv-torch-* *.egg-info
