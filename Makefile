# Two commands do everything on a fresh clone: `make demo` and `make test`.
# Both create .venv/ on first use. torch is installed first, pinned (TORCH_SPEC), so that resolving lightning does not
# pull another build; a later `pip install -e .` accepts the torch already there. Which build the pin resolves to is
# the package index's choice: the CPU build where pip's index serves it (as on the project's machines), the CUDA
# build from PyPI on Linux x86-64 (README: Install, for the CPU index).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
export OMP_NUM_THREADS ?= 1

.PHONY: demo test lint typecheck docs setup clean gpu-check

# litgpt (tests/parallel/test_tensor_parallel_plans.py) without its dependencies: litgpt 0.5 pins huggingface-hub<1.4
# and transformers 5 needs >=2.4, so the test extra cannot hold both. Its model code needs neither the pin nor
# anything the test extra lacks (lightning, jsonargparse, safetensors, tokenizers, psutil, tqdm).
LITGPT_SPEC ?= litgpt==0.5.13

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[test]"
	$(BIN)/pip install --quiet --no-deps "$(LITGPT_SPEC)"
	touch $@

# tests/strategy/test_mpi.py launches with mpirun, which needs OpenMPI and mpi4py (the `mpi` extra). Best effort: OpenMPI from
# apt-get where we are root, otherwise the reason is printed and those tests skip with it. mpi4py goes into a folder
# of its own that only those launches put on their path: in the venv, Lightning's MPIEnvironment.detect would start
# MPI in every Trainer of the suite, and fail them all on a machine without an MPI library.
MPI_SITE := $(VENV)/mpi-site
MPI_PACKAGES := openmpi-bin libopenmpi-dev
APT_INSTALL := DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(MPI_PACKAGES)

setup: $(BIN)/.installed $(MPI_SITE)/.installed

$(MPI_SITE)/.installed: | $(BIN)/.installed
	@if ! command -v mpirun >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "Installing OpenMPI ($(MPI_PACKAGES)) for the mpirun tests"; \
	    $(APT_INSTALL) >/dev/null 2>&1 || { apt-get update -qq && $(APT_INSTALL) >/dev/null; } \
	      || echo "OpenMPI could not be installed: tests/strategy/test_mpi.py will be skipped"; \
	  else \
	    echo "No mpirun, and no apt-get as root to install OpenMPI: tests/strategy/test_mpi.py will be skipped"; \
	  fi; \
	fi
	@if command -v mpirun >/dev/null 2>&1; then \
	  $(BIN)/pip install --quiet --target $(MPI_SITE) "mpi4py>=3.1" && touch $@; \
	fi

demo: setup
	$(BIN)/python examples/demo.py

# The linter and formatter first (seconds), the type checker (under a minute; configuration in pyproject.toml), then
# the suite.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: setup
	$(BIN)/mypy

test: lint typecheck
	$(BIN)/python -m pytest -q

# On a machine with a CUDA GPU (a few minutes): the engine on nccl, bf16, activation checkpointing, cpu_offload, a
# sharded checkpoint round trip, and step time / peak memory of a 125M GPT against plain training and torch FSDP2.
# It runs with the machine's own Python and CUDA build of torch (the .venv holds the CPU build), from the clone.
gpu-check:
	PYTHONPATH=$(CURDIR) $(PYTHON) -m benchmarks.gpu_check --out gpu-check

docs: setup
	$(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) lightning_logs .pytest_cache .mypy_cache site
