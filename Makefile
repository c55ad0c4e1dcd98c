# `make test` and `make demo` bootstrap their own virtual environment.
# The pinned CPU torch goes in first: an unpinned `torch` would pull a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0

.PHONY: test demo venv clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

test: $(VENV)/.installed
	OMP_NUM_THREADS=1 $(PY) -m pytest -q tests

demo: $(VENV)/.installed
	$(PY) examples/plan_llama.py

clean:
	rm -rf $(VENV) *.egg-info
