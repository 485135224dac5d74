# Everything installs into the checkout's own virtual environment, made on first use;
# PYTHON=python3 (or any interpreter) installs into that interpreter's environment instead.
VENV ?= .venv
PYTHON ?= $(VENV)/bin/python
PIP := $(PYTHON) -m pip
# The CPU build of torch: no multi-GB CUDA wheels when only the CPU is used.
TORCH ?= torch==2.13.0
# The environment to make first, when PYTHON is the checkout's own.
ENV := $(filter $(VENV)/bin/python,$(PYTHON))

.PHONY: install install-dev demo test bench bench-quick bench-settings

$(VENV)/bin/python:
	python3 -m venv $(VENV)

install: $(ENV)
	$(PIP) install -q "$(TORCH)" -e .

install-dev: $(ENV)
	$(PIP) install -q "$(TORCH)" -e ".[dev]"

demo: install
	$(PYTHON) examples/quickstart.py

# Test workers (pytest-xdist): each runs whole tests, several of which start processes of
# their own; `make test WORKERS=0` runs the suite in one process.
WORKERS ?= 2

test: install-dev
	$(PYTHON) -m pytest -n $(WORKERS)

# `make bench QUICK=1` is the same as `make bench-quick`.
bench: install-dev
	$(PIP) install -q -e ".[bench]"
	$(PYTHON) benchmarks/compare.py $(if $(QUICK),--quick)

bench-quick: install-dev
	$(PIP) install -q -e ".[bench]"
	$(PYTHON) benchmarks/compare.py --quick

bench-settings: install-dev
	$(PIP) install -q -e ".[bench]"
	$(PYTHON) benchmarks/chain_bench.py
