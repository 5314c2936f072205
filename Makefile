# The menu: `make help`.
SHELL := /bin/bash
PY := .venv/bin/python
TORCH_VERSION ?= 2.13.0
export OMP_NUM_THREADS ?= 2

DRY_RUN ?= 0
DRY := $(if $(filter 1,$(DRY_RUN)),--dry-run,)
FAMILY ?= tiny
NODES_FILE ?= configs/local/nodes.txt
export NODES_FILE

.PHONY: help setup demo test lint clean replicate-tiny replicate-150m replicate-1b ablation-fp16 report check sweep-tiny

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

replicate-tiny: setup  ## the whole CPU-scale family here (~20 min on 2 cores), then its report and check
	$(PY) scripts/replicate.py --family tiny
	$(PY) scripts/report.py --family tiny
	$(PY) scripts/check.py --family tiny

replicate-150m: setup  ## all 150M runs of the paper, in order, on the GPU nodes in NODES_FILE (DRY_RUN=1: plan + 2 CPU steps each)
	$(PY) scripts/replicate.py --family 150m $(DRY)

replicate-1b: setup  ## the 1.1B runs (4 nodes of 8 GPUs) on the nodes in NODES_FILE (DRY_RUN=1 as above)
	$(PY) scripts/replicate.py --family 1b $(DRY)

ablation-fp16: setup  ## the FP16 vs FP32 pseudo-gradient runs (4 and 8 workers, 150M) (DRY_RUN=1 as above)
	$(PY) scripts/replicate.py --family fp16 $(DRY)

sweep-tiny: setup  ## the outer lr / momentum / H sweep behind the tiny family's DiLoCo settings
	$(PY) scripts/sweep_tiny.py

report: setup  ## results/$(FAMILY)/report.md with plots, and a W&B report when online (FAMILY=tiny|150m|1b)
	$(PY) scripts/report.py --family $(FAMILY)

check: setup  ## judge finished runs in runs/ against the paper (results/reference.yaml); non-zero on a miss
	$(PY) scripts/check.py

clean:  ## remove runs and caches (keeps .venv)
	rm -rf runs outputs multirun .pytest_cache .ruff_cache

# Benchmarks (issue #7): each script prints a table and writes results/bench/<name>.json; the report
# turns them into results/bench/README.md. CPU ones take under 20 minutes on 2 cores.
BENCH_ENV := WANDB_MODE=disabled HF_DATASETS_OFFLINE=1
BENCH_CPU := wire trainer comm_volume outer_step boundary utilization

.PHONY: bench bench-gpu

bench: setup  ## CPU benchmarks (outer step, boundary stall, wire, trainer, utilization, bytes) -> results/bench/
	@set -e; for b in $(BENCH_CPU); do echo "== bench_$$b"; $(BENCH_ENV) $(PY) scripts/bench_$$b.py; done
	$(PY) scripts/bench_report.py

bench-gpu: setup  ## GPU benchmarks (150M tokens/s, MFU, torch.compile, outer step; trainer at 150M) -> results/bench/
	$(BENCH_ENV) $(PY) scripts/bench_gpu.py
	$(BENCH_ENV) $(PY) scripts/bench_trainer.py --models 150m --device cuda
	$(PY) scripts/bench_report.py
