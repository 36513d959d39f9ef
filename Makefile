# Usual tasks.  Everything runs in a local virtual environment (.venv) that
# `make setup` creates from the project's own files: nothing to install by hand.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# a CPU build of torch; set TORCH=torch (or a CUDA wheel) on GPU machines
TORCH  ?= torch==2.13.0
# local MPI ranks for `make train`: one per core, at most 4
NP     ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 4 ] && n=4; echo $$n)

# the engine's sources (Cython's generated _core.c and _xbraid.c are outputs, not
# sources: counting them made the first target after `make build` rebuild both)
NATIVE := $(filter-out layerpar/_native/_core.c layerpar/_native/_xbraid.c,\
	$(wildcard layerpar/_native/*.c)) $(wildcard layerpar/_native/*.h) \
	layerpar/_native/_core.pyx layerpar/_native/lpm.pxd

# Optional XBraid engine (engine="xbraid"), built from an XBraid source tree, never
# vendored: `XBRAID_DIR=/path/to/xbraid make build` compiles its libbraid.a with the
# venv's mpicc (if not built yet) and our wrapper against it.  In a checkout with
# ../shared/xbraid beside it (CI), a copy of that tree in build/xbraid is used.
ifeq ($(origin XBRAID_DIR),undefined)
ifneq ($(wildcard $(CURDIR)/../shared/xbraid/braid/braid.h),)
XBRAID_DIR := $(CURDIR)/build/xbraid
XBRAID_FROM := $(abspath $(CURDIR)/../shared/xbraid)
endif
endif
XBRAID_DIR ?=
XBRAID_BUILT := $(if $(XBRAID_DIR),$(VENV)/.built-xbraid)

.PHONY: setup build test test-fast bench bench-ops bench-gpu bench-grid bench-engines bench-paths \
	bench-sync bench-tta bench-tta-smoke bench-versus bench-versus-smoke bench-tta-gpu bench-tta-gpu-compiled study-cpu-16core \
	study-cpu-16core-scale \
	study-cpu-16core-tta study-cpu-16core-versus bench-versus-gpu device-wheels device-setup cuda-check test-gpu test-triton train lint typecheck \
	clean help

# One .venv, filled by what each target needs: `make setup` (and `make train`) the
# package, MPI and what the `layerpar` command's problems and studies import; `make test`
# adds the test tools (SETUP_TEST); `make test-triton` adds Triton (about 1 GB, only for
# its own tests: without it they are skipped).  Any order works from a fresh clone.
SETUP_EXTRAS ?= mpich,examples,studies
SETUP_TEST   := $(VENV)/.installed-test
SETUP_TRITON := $(VENV)/.installed-triton

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)" "setuptools>=68" "Cython>=3" wheel
	XBRAID_DIR= $(BIN)/python -m pip install -q --no-build-isolation -e ".[$(SETUP_EXTRAS)]"
	touch $@ $(VENV)/.built

# an extra's requirements alone, as the installed package's metadata lists them (from
# pyproject.toml): installing `-e ".[test]"` again would rebuild the engine without XBraid
EXTRA_REQUIREMENTS = $(BIN)/python -c "import re, sys; from importlib.metadata import \
	requires; tag = re.compile(r'[ ]*(and[ ]+)?extra[ ]*==[ ]*.([-a-z0-9_.]+).'); \
	print(chr(10).join(tag.sub('', r).strip().rstrip(';') for r in requires('layerpar') \
	or () if sys.argv[1] in [m.group(2) for m in tag.finditer(r)]))"
$(SETUP_TEST): $(VENV)/.installed
	$(EXTRA_REQUIREMENTS) test > $(VENV)/requirements-test.txt
	$(BIN)/python -m pip install -q -r $(VENV)/requirements-test.txt
	touch $@
$(SETUP_TRITON): $(SETUP_TEST)
	$(EXTRA_REQUIREMENTS) triton > $(VENV)/requirements-triton.txt
	$(BIN)/python -m pip install -q -r $(VENV)/requirements-triton.txt
	touch $@

# rebuild the native engine when its sources change
build: $(VENV)/.built $(XBRAID_BUILT)
$(VENV)/.built: $(VENV)/.installed $(NATIVE)
	XBRAID_DIR= $(BIN)/python -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

# the XBraid engine (only with XBRAID_DIR); the native one is rebuilt beside it
$(VENV)/.built-xbraid: $(VENV)/.built layerpar/_native/_xbraid.pyx layerpar/_native/braid_h.pxd
ifneq ($(XBRAID_FROM),)
	test -f build/xbraid/braid/braid.h || (mkdir -p build && cp -r $(XBRAID_FROM) build/xbraid)
endif
	PATH="$(abspath $(BIN)):$$PATH" XBRAID_DIR="$(XBRAID_DIR)" \
		$(BIN)/python -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

test: build $(SETUP_TEST)
	$(BIN)/python -m pytest -q

test-fast: build $(SETUP_TEST)
	$(BIN)/python -m pytest -q -m "not slow"

# the fused Triton steps on the CPU, under Triton's interpreter (installs the extra)
test-triton: build $(SETUP_TRITON)
	$(BIN)/python -m pytest -q tests/test_triton_kernels.py

bench: build
	$(BIN)/python -m layerpar.bench
	$(BIN)/mpiexec -n 2 $(BIN)/python -m mpi4py -m layerpar.bench

# both engines at the same settings, 1 and 2 ranks (needs the XBraid engine: XBRAID_DIR)
ENGINES_1 := $(BIN)/python -m layerpar.bench engines --csv docs/results/engines/engines.csv
ENGINES_2 := $(BIN)/mpiexec -n 2 $(BIN)/python -m mpi4py -m layerpar.bench engines \
	--csv docs/results/engines/engines-np2.csv
bench-engines: build
	mkdir -p docs/results/engines
	echo '$$ $(ENGINES_1)' > docs/results/engines/engines.txt
	$(ENGINES_1) | tee -a docs/results/engines/engines.txt
	echo '$$ $(ENGINES_2)' >> docs/results/engines/engines.txt
	$(ENGINES_2) | tee -a docs/results/engines/engines.txt

bench-ops: build
	$(BIN)/python -m layerpar.bench ops --csv docs/results/ops/ops.csv | tee docs/results/ops/ops.txt

# batched="auto" (the default) against vectorised and per-step cycles, and vectorised
# cycles (docs/results/paths/)
bench-paths: build
	$(BIN)/python -m layerpar.bench paths --ranks 1 2 --csv docs/results/paths/paths.csv | tee docs/results/paths/paths.txt

# data x layer splits of 4 processes, under mpiexec and torchrun (docs/results/grid/)
bench-grid: build
	$(BIN)/python -m layerpar.bench grid --np 4 --csv docs/results/grid/grid.csv | tee docs/results/grid/grid.txt

# time to accuracy, serial vs --auto at TTA_NP ranks, cases a-d (docs/results/tta/npN; it
# prints its own estimate first); the smoke run checks the pipeline (its figures are not a
# measurement) and writes under out/, which git ignores: twelve short trainings, most of
# whose time is starting processes, so its duration follows the machine's load (it
# measures a start-up and prints its estimate first)
TTA_NP ?= 2
TTA_SMOKE_OUT ?= out/tta/smoke
bench-tta: build
	$(BIN)/python -m layerpar.bench tta --np $(TTA_NP) --out docs/results/tta/np$(TTA_NP)
bench-tta-smoke: build
	$(BIN)/python -m layerpar.bench tta --smoke --np 2 --out $(TTA_SMOKE_OUT)

# every method at the same ranks, to each case's accuracy (docs/results/versus/); on the
# 16-core device machine: `make bench-versus VERSUS_NP=16` (and 2, 4, 8).  VERSUS_REPEATS:
# runs of each comparison, one after the other (a noisy machine's drift falls alike on
# every method; README gives each run's ratios and their median)
VERSUS_NP ?= 2
VERSUS_CASES ?= a,f,e,c,d
VERSUS_REPEATS ?= 1
bench-versus: build
	$(BIN)/python -m layerpar.bench versus --np $(VERSUS_NP) --cases $(VERSUS_CASES) \
		--repeats $(VERSUS_REPEATS) --out docs/results/versus/np$(VERSUS_NP)
bench-versus-smoke: build
	$(BIN)/python -m layerpar.bench versus --smoke --np 2 --out out/versus/smoke

# The device rows (results: docs/results/tta/README.md): time to accuracy on one GPU,
# case a; on the 16 CPU cores
# beside it, the per-batch scaling study at 1-16 ranks (MGRIT structures of 3-5 levels,
# cfactor 4 and 8: the fastest at each rank count is printed) and time to accuracy at
# 16 ranks.
# On a lent device machine (`device` tool): no network there, and its python3
# (GPU_PYTHON) holds CUDA torch, Cython, mpi4py and Open MPI, numpy, scipy, matplotlib
# and scikit-learn, but not mnist1d.  So:
#   here, once:  make device-wheels      (mnist1d's wheel into .whl/, ignored by git)
#   there, one call per target, carrying .whl (a call may take 10 minutes; on the H200:
#   bench-tta-gpu ~340 s (413 s on an H100), study-cpu-16core-tta ~240 s,
#   study-cpu-16core-scale ~75 s with one structure, before it scanned six: not
#   timed since):
#     make DEVICE=1 bench-tta-gpu && cp -r docs/results/tta/gpu $OUT/
#     make DEVICE=1 bench-tta-gpu-compiled   (serial also under torch.compile: not run
#         yet; expect about 10 minutes in all)
#     make DEVICE=1 study-cpu-16core-scale && cp docs/results/scaling/cpu-16core-scan/* $OUT/
#     make DEVICE=1 study-cpu-16core-tta && cp docs/results/tta/cpu-16core/* $OUT/
#     make DEVICE=1 bench-gpu && cp docs/results/gpu/bench-gpu-rows.csv $OUT/
#     make DEVICE=1 test-gpu   (the GPU tests alone: run them first)
# DEVICE=1 builds the engine in place with GPU_PYTHON, installs the carried wheels into
# DEVICE_SITE (device-setup) and puts both on PYTHONPATH (workers started from a script
# import layerpar from there; nothing is installed); without it, the 16-core targets use
# this checkout's .venv (a 16-core machine with a network).
GPU_PYTHON ?= python3
DEVICE ?=
DEVICE_SITE ?= /tmp/layerpar-site
MNIST1D_WHEEL ?= mnist1d==0.0.2.post1
DEVICE_ENV := PYTHONPATH=$(DEVICE_SITE):$(CURDIR) OMPI_ALLOW_RUN_AS_ROOT=1 \
	OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
ifeq ($(DEVICE),1)
DEVICE_PY := $(DEVICE_ENV) $(GPU_PYTHON)
DEVICE_PREP := device-setup
else
DEVICE_PY := $(BIN)/python
DEVICE_PREP := build
endif
device-wheels: setup
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: -d .whl "$(MNIST1D_WHEEL)"
device-setup:
	$(GPU_PYTHON) setup.py -q build_ext --inplace
	if ls .whl/*.whl >/dev/null 2>&1; then \
	    $(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile --upgrade \
	        --target $(DEVICE_SITE) .whl/*.whl; \
	elif ! $(GPU_PYTHON) -c "import mnist1d" 2>/dev/null; then \
	    echo "device-setup: mnist1d is missing and no wheels are in .whl/ (run" \
	        "'make device-wheels' on the development machine and carry .whl)"; exit 1; fi
# the GPU targets first ask GPU_PYTHON for a CUDA device: on a machine without one, one
# line instead of a Cython traceback from the build (or GPU tests that all skip, exit 0)
cuda-check:
	@$(GPU_PYTHON) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
	    2>/dev/null || { echo "make: $(MAKECMDGOALS) needs a CUDA device and a CUDA build of" \
	    "torch in GPU_PYTHON ($(GPU_PYTHON)): run it on a GPU machine, as" \
	    "'make DEVICE=1 $(MAKECMDGOALS)' (see the comments above these targets)"; exit 2; }
TTA_GPU_OUT ?= docs/results/tta/gpu
bench-tta-gpu: cuda-check device-setup
	$(DEVICE_ENV) $(GPU_PYTHON) -m layerpar.bench tta --device cuda --np 1 \
	    --cases a --bounds default --out $(TTA_GPU_OUT)
bench-tta-gpu-compiled: cuda-check device-setup
	$(DEVICE_ENV) $(GPU_PYTHON) -m layerpar.bench tta --device cuda --np 1 \
	    --cases a --bounds default --compiled-serial --out docs/results/tta/gpu-compiled
study-cpu-16core: study-cpu-16core-scale study-cpu-16core-tta
study-cpu-16core-scale: $(DEVICE_PREP)
	$(DEVICE_PY) -m layerpar.apps.cli scale --ranks 1,2,4,8,16 --layers 1024 --width 32 \
	    --batch 128 --levels 3,4,5 --cfactor 4,8 --fwd-iters 1 --bwd-iters 1 --no-progress \
	    --out docs/results/scaling/cpu-16core-scan
study-cpu-16core-tta: $(DEVICE_PREP)
	$(DEVICE_PY) -m layerpar.bench tta --np 16 --cases a --bounds default \
	    --out docs/results/tta/cpu-16core
# every method on the 16 cores at 2, 4, 8 and 16 ranks (docs/results/versus/cpu-16core/);
# and on one GPU the latency-bound net and the conv ResNet, auto captured against
# captured serial (docs/results/versus/gpu/)
study-cpu-16core-versus: $(DEVICE_PREP)
	for n in 2 4 8 16; do $(DEVICE_PY) -m layerpar.bench versus --np $$n --cases a,e \
	    --no-compiled-serial --out docs/results/versus/cpu-16core/np$$n || exit 1; done
bench-versus-gpu: cuda-check device-setup
	$(DEVICE_ENV) $(GPU_PYTHON) -m layerpar.bench tta --device cuda --np 1 \
	    --cases a,e --bounds default --out docs/results/versus/gpu
bench-sync: build
	$(BIN)/python -m layerpar.bench sync --csv docs/results/sync/bench.csv | tee docs/results/sync/bench.txt

# On a GPU machine, with a Python that has a CUDA build of torch (and Cython, triton):
# builds the engine in place and writes its four rows to docs/results/gpu/bench-gpu-rows.csv
# (docs/results/gpu/bench-gpu.csv: the run the GPU model is calibrated on).  GPU tests:
# tests/gpu.
bench-gpu: cuda-check
	$(GPU_PYTHON) setup.py -q build_ext --inplace
	mkdir -p docs/results/gpu
	$(GPU_PYTHON) -m layerpar.bench gpu --models dense,conv,conv16,transformer \
	    --csv docs/results/gpu/bench-gpu-rows.csv
	$(GPU_PYTHON) -m pytest -q -p no:cacheprovider tests/gpu

# The GPU tests alone (six of them took 10 s on the H200): on a lent device,
# `make DEVICE=1 test-gpu` (carrying .whl), before the benchmarks that depend on them
test-gpu: cuda-check device-setup
	$(DEVICE_ENV) $(GPU_PYTHON) -m pytest -q -p no:cacheprovider tests/gpu

train: build
	$(BIN)/layerpar train peaks --np $(NP)

lint: $(SETUP_TEST) typecheck
	$(BIN)/ruff check layerpar tests examples

# mypy over the type-checked set that pyproject.toml's [tool.mypy] names
typecheck: $(SETUP_TEST)
	$(BIN)/python -m mypy

help:
	@echo "make train            set up (.venv, torch, MPI, engine) and train Peaks layer-parallel"
	@echo "make test             set up and run the test suite (what CI runs)"
	@echo "make test-fast        the tests not marked slow"
	@echo "make test-triton      the fused Triton kernels under Triton's interpreter (installs triton, ~1 GB)"
	@echo "make build            (re)build the native engine (and XBraid's, with XBRAID_DIR)"
	@echo "make lint             ruff over layerpar, tests and examples, and typecheck"
	@echo "make typecheck        mypy over the typed packages (pyproject.toml [tool.mypy])"
	@echo "make bench            engine and training micro-benchmarks, 1 and 2 ranks"
	@echo "make bench-ops        tensor operations per batch, serial against MGRIT"
	@echo "make bench-engines    native engine against XBraid"
	@echo "make bench-paths      batched against per-step cycles on users' blocks"
	@echo "make bench-versus     every method at P ranks to each case's accuracy (VERSUS_NP=2)"
	@echo "make bench-grid       data x layer grids over MPI and torch.distributed"
	@echo "make bench-sync       replica synchronisation: all-reduce, DASO, Lion Cub"
	@echo "make bench-tta        time to accuracy, serial against --auto (long: ~45 min)"
	@echo "make bench-tta-smoke  the same, every case shrunk, into out/tta/smoke (not a measurement;"
	@echo "                      it prints its own estimate of the time first)"
	@echo "GPU machine (DEVICE=1): device-wheels (here), then test-gpu, bench-gpu,"
	@echo "  bench-tta-gpu, bench-tta-gpu-compiled, study-cpu-16core (docs/guide/gpu.md)"
	@echo "make clean            remove build outputs (not .venv)"

clean:
	rm -rf build *.egg-info layerpar/_native/_core.c layerpar/_native/_xbraid.c \
		layerpar/_native/*.so $(VENV)/.built-xbraid
