# Whale for PyTorch: `make train` runs the main job, `make test` runs the tests.
# Both create and reuse .venv; torch is pinned exactly here (a range would pull a CUDA build).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION := 2.13.0
STAMP := $(VENV)/.installed-$(TORCH_VERSION)
NPROC ?= 4
CLUSTER ?= examples/clusters/v100_p100.yaml
TRAIN_ARGS ?=

.PHONY: setup train train-hf train-elastic test test-durations test-cpu lint bench bench-all report clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==$(TORCH_VERSION) numpy
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

data/shakespeare/.ready: $(STAMP) examples/gpt/data.py
	$(PY) -m examples.gpt.data --fetch

train: $(STAMP) data/shakespeare/.ready
	$(VENV)/bin/whale launch -n $(NPROC) $(if $(CLUSTER),--cluster $(CLUSTER)) examples/gpt/train.py $(TRAIN_ARGS)

train-hf: $(STAMP) data/shakespeare/.ready
	$(VENV)/bin/whale launch -n $(NPROC) $(if $(CLUSTER),--cluster $(CLUSTER)) examples/hf/train.py $(TRAIN_ARGS)

# Two emulated nodes (docs/elastic.md): node b is killed mid-run, node a re-plans and continues, b rejoins, re-expand
train-elastic: $(STAMP) data/shakespeare/.ready
	PYTHONPATH=src:. $(PY) examples/elastic/demo.py $(TRAIN_ARGS)

# pytest-xdist workers (each with its own forkserver for the gloo ranks), handed one test at a time, longest first
# (tests/conftest.py reads tests/durations.json). More than the cores oversubscribe the 4-rank tests;
# TEST_JOBS=0 runs in one process. `make test-durations` re-measures the lengths (a full run).
TEST_JOBS ?= 2

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest $(if $(filter-out 0,$(TEST_JOBS)),-n $(TEST_JOBS) --dist load --maxschedchunk 1) $(PYTEST_ARGS)

test-durations: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q --durations=0 $(if $(filter-out 0,$(TEST_JOBS)),-n $(TEST_JOBS) --dist load --maxschedchunk 1) > .durations.log || (tail -20 .durations.log; exit 1)
	$(PY) tests/scripts/durations.py .durations.log tests/durations.json

# CPU seconds per test (tests/scripts/cpu_seconds.py): the suite's CPU floor on this host, a full run
test-cpu: $(STAMP)
	rm -f .cpu_seconds.jsonl
	HF_HUB_OFFLINE=1 WHALE_CPU_LOG=$(CURDIR)/.cpu_seconds.jsonl $(PY) -m pytest -q -p tests.scripts.cpu_seconds $(if $(filter-out 0,$(TEST_JOBS)),-n $(TEST_JOBS) --dist load --maxschedchunk 1) > .cpu_seconds.log || (tail -20 .cpu_seconds.log; exit 1)
	$(PY) tests/scripts/cpu_seconds.py .cpu_seconds.jsonl

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests examples benchmarks

bench: $(STAMP)
	$(PY) benchmarks/dp_overhead.py --out benchmarks/results/dp_overhead.json

bench-all: $(STAMP)
	PY=$(PY) bash benchmarks/run_all.sh

report: $(STAMP)
	$(PY) benchmarks/report.py
	-$(PY) benchmarks/report.py --stale

clean:
	rm -rf $(VENV) data/shakespeare checkpoints
