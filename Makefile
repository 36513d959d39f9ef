# Usual tasks.  Everything runs in a local virtual environment (.venv) that
# `make setup` creates from the project's own files: nothing to install by hand.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# a CPU build of torch; set TORCH=torch (or a CUDA wheel) on GPU machines
TORCH  ?= torch==2.13.0
# local MPI ranks for `make train`: one per core, at most 4
NP     ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 4 ] && n=4; echo $$n)

NATIVE := $(wildcard layerpar/_native/*.c layerpar/_native/*.h layerpar/_native/*.pyx layerpar/_native/*.pxd)

.PHONY: setup build test test-fast bench bench-ops bench-gpu bench-grid bench-sync train lint clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)" "setuptools>=68" "Cython>=3" wheel
	$(BIN)/python -m pip install -q --no-build-isolation -e ".[mpich,test,examples,studies]"
	touch $@ $(VENV)/.built

# rebuild the native engine when its sources change
build: $(VENV)/.built
$(VENV)/.built: $(VENV)/.installed $(NATIVE)
	$(BIN)/python -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

test: build
	$(BIN)/python -m pytest -q

test-fast: build
	$(BIN)/python -m pytest -q -m "not slow"

bench: build
	$(BIN)/python -m layerpar.bench
	$(BIN)/mpiexec -n 2 $(BIN)/python -m mpi4py -m layerpar.bench

bench-ops: build
	$(BIN)/python -m layerpar.bench ops --csv docs/bench/ops.csv

# data x layer splits of 4 processes, under mpiexec and torchrun (docs/bench/grid.*)
bench-grid: build
	$(BIN)/python -m layerpar.bench grid --np 4 --csv docs/bench/grid.csv | tee docs/bench/grid.txt

bench-sync: build
	$(BIN)/python -m layerpar.bench sync --csv docs/sync/bench.csv | tee docs/sync/bench.txt

# On a GPU machine, with a Python that has a CUDA build of torch (and Cython):
# builds the engine in place and writes docs/gpu/bench-gpu.csv.  GPU tests: tests/gpu.
GPU_PYTHON ?= python3
bench-gpu:
	$(GPU_PYTHON) setup.py -q build_ext --inplace
	mkdir -p docs/gpu
	$(GPU_PYTHON) -m layerpar.bench gpu --csv docs/gpu/bench-gpu.csv
	$(GPU_PYTHON) -m pytest -q -p no:cacheprovider tests/gpu

train: build
	$(BIN)/layerpar train peaks --np $(NP)

lint: setup
	$(BIN)/ruff check layerpar tests examples

clean:
	rm -rf build *.egg-info layerpar/_native/_core.c layerpar/_native/*.so
