# The menu: `make help`.
SHELL := /bin/bash
PY := .venv/bin/python
TORCH_VERSION ?= 2.13.0
export OMP_NUM_THREADS ?= 2

.PHONY: help setup demo test lint clean

help:  ## list what can be run
	@grep -E '^[a-zA-Z0-9_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  make %-18s %s\n", $$1, $$2}'

.venv/.installed: pyproject.toml
	@test -d .venv || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	@# No CUDA here: install the CPU wheel first so the torch range in pyproject pulls no CUDA build.
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(PY) -m pip install -q "torch>=2.4,<2.15"; \
	else \
		$(PY) -m pip install -q "torch==$(TORCH_VERSION)" --index-url https://download.pytorch.org/whl/cpu \
			--retries 0 --timeout 15 || $(PY) -m pip install -q "torch==$(TORCH_VERSION)"; \
	fi
	$(PY) -m pip install -q -e ".[dev]"
	@touch $@

setup: .venv/.installed  ## create .venv and install the project (CPU torch where there is no CUDA)

demo: setup  ## train the micro model on the bundled sample (a few minutes on 2 CPU cores)
	WANDB_MODE=$${WANDB_MODE:-offline} $(PY) -m diloco.train experiment=demo

lint: setup  ## ruff
	$(PY) -m ruff check src tests scripts
	$(PY) -m ruff format --check src tests scripts

test: setup lint  ## lint + the whole test suite (under 10 minutes on 2 cores)
	$(PY) -m pytest -q

clean:  ## remove runs and caches (keeps .venv)
	rm -rf runs outputs multirun .pytest_cache .ruff_cache
