# `make demo` and `make test` each bootstrap .venv from nothing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: sandbox-tools demo test test-fast test-thorough bench plan clean gpu-check

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0          # local CPU wheel first
	$(PIP) install -q -c constraints.txt -e '.[dev,triton,ray,train,bench,wandb,mlflow,service]'
	@if $(PIP) list 2>/dev/null | grep -qi nvidia; then echo "CUDA packages were pulled in: check constraints.txt" >&2; exit 1; fi
	touch $@

# The code reward's sandbox (docs/security.md): bubblewrap, installed when missing if we can; never fatal.
sandbox-tools:
	@bash tools/install_bwrap.sh

demo: $(STAMP) sandbox-tools
	$(PY) -m rlgraph.cli demo

test: $(STAMP) sandbox-tools
	$(PY) -m pytest -q -n 2 --dist worksteal --durations=15

test-fast: $(STAMP) sandbox-tools
	$(PY) -m pytest -q -n 2 --dist worksteal -m "not slow"

# The nightly run: every property with 500 examples instead of 25 (docs/testing.md).
test-thorough: $(STAMP) sandbox-tools
	HYPOTHESIS_PROFILE=thorough $(PY) -m pytest -q -n 2 --durations=15

bench: $(STAMP)
	$(PY) benchmarks/kernels.py

# On a machine with one CUDA GPU and no registry: uses python3's own torch/triton/transformers, no venv
# (docs/gpu.md). Output in gpu-check/.
gpu-check:
	bash tools/gpu_check.sh gpu-check

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis runs
