# Two commands do everything on a fresh clone: `make demo` and `make test`.
# Both create .venv/ on first use. torch is pinned to the CPU build first, so that resolving lightning does not
# pull a multi-GB CUDA build; a later `pip install -e .` accepts the torch already there.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
export OMP_NUM_THREADS ?= 1

.PHONY: demo test lint docs setup clean gpu-check

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[test]"
	touch $@

setup: $(BIN)/.installed

demo: setup
	$(BIN)/python examples/demo.py

# The linter and formatter first (seconds), then the suite.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/python -m pytest -q

# On a machine with a CUDA GPU (a few minutes): the engine on nccl, bf16, activation checkpointing, cpu_offload, a
# sharded checkpoint round trip, and step time / peak memory of a 125M GPT against plain training and torch FSDP2.
# It runs with the machine's own Python and CUDA build of torch (the .venv holds the CPU build), from the clone.
gpu-check:
	PYTHONPATH=$(CURDIR) $(PYTHON) -m benchmarks.gpu_check --out gpu-check

docs: setup
	$(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) lightning_logs .pytest_cache site
