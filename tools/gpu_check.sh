#!/usr/bin/env bash
# Validate rlgraph's GPU paths on a machine with one CUDA GPU and no package registry, in one command.
#
#   bash tools/gpu_check.sh [OUT_DIR]        # default OUT_DIR: gpu-check/
#   bash tools/gpu_check.sh --smoke [OUT]    # the CPU-safe parts only (make test runs this)
#
# It expects python3 to hold torch (CUDA), triton, transformers, peft, attrs, rich, pyyaml,
# pyarrow, hypothesis and pytest (the lent H100/H200 image does). Wheels it lacks (pydantic,
# pydantic-core, annotated-types, typing-inspection, typing-extensions) are installed from
# .whl/ when that folder exists (see docs/gpu.md for how to fill it). Each step's output goes to
# OUT_DIR/<step>.log and a one-line verdict to OUT_DIR/summary.txt; a failing step does not stop
# the others. Exit status: the number of failed steps.
set -uo pipefail
cd "$(dirname "$0")/.."
SMOKE=0
if [[ "${1:-}" == "--smoke" ]]; then SMOKE=1; shift; fi
OUT="${1:-gpu-check}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
: >"$OUT/summary.txt"
FAILED=0

if [[ -d .whl ]] && ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/rlgraph-site .whl/*.whl \
        >"$OUT/wheels.log" 2>&1 && export PYTHONPATH="/tmp/rlgraph-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # the project itself, without an install step
export PYTHONUNBUFFERED=1

step() {  # step NAME TIMEOUT_S COMMAND...
    local name=$1 limit=$2; shift 2
    local start=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    local verdict=ok; [[ $rc -ne 0 ]] && { verdict="FAILED (exit $rc)"; FAILED=$((FAILED + 1)); }
    local command="$*"; command="${command//$'\n'/ }"
    printf '%-24s %-18s %4ds  %.110s\n' "$name" "$verdict" $((SECONDS - start)) "$command" | tee -a "$OUT/summary.txt"
}

step environment 60 $PY -c "
import platform, torch, triton, transformers
print('python', platform.python_version(), 'torch', torch.__version__, 'triton', triton.__version__,
      'transformers', transformers.__version__)
print('cuda', torch.cuda.is_available(), torch.version.cuda,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-')
import rlgraph; print('rlgraph from', rlgraph.__file__)"

if [[ $SMOKE -eq 1 ]]; then
    step kernels-smoke 600 $PY benchmarks/kernels.py --smoke --no-compile  # torch.compile columns: the GPU run
    step gpu-tests-collect 120 $PY -m pytest -q --collect-only tests/gpu
    exit $FAILED
fi

nvidia-smi >"$OUT/nvidia-smi.log" 2>&1
step gpu-tests 900 $PY -m pytest -v -rs -p no:cacheprovider tests/gpu
step demo-cuda 600 $PY -m rlgraph demo --device cuda --rl-seconds 60 --run-dir "$OUT/runs/demo"
step train-local-cuda 600 $PY -m rlgraph train examples/math_grpo/config.yaml -o runtime.device=cuda \
    -o train.steps=100 -o logging.progress=false -o logging.plots=false -o run_dir="$OUT/runs/train-local"
step train-spmd-nccl 600 $PY -m rlgraph train examples/math_grpo/config.yaml -o runtime.device=cuda \
    -o runtime.runtime=spmd -o runtime.nproc=1 -o train.steps=50 -o logging.progress=false \
    -o logging.plots=false -o run_dir="$OUT/runs/train-spmd"
step kernels 900 $PY benchmarks/kernels.py
# vLLM with the official CUDA wheel, when python3 has it (docs/vllm.md): the live engine tests (sleep mode,
# fp32 parity, bucketed sync) and the math example generating on vLLM.
if $PY -c "import vllm" >/dev/null 2>&1; then
    step vllm-tests 900 $PY -m pytest -v -rs -p no:cacheprovider tests/backends/test_vllm_live.py \
        tests/backends/test_vllm_local.py
    step train-local-vllm 900 $PY -m rlgraph train examples/math_grpo/config.yaml -o runtime.device=cuda \
        -o runtime.engine=vllm -o model.path=rlgraph/assets/tiny_qwen2_vllm.json -o algorithm.hparams.tis_cap=2.0 \
        -o train.steps=100 -o logging.progress=false -o logging.plots=false -o run_dir="$OUT/runs/train-vllm"
else
    printf '%-24s %s\n' vllm "skipped: $PY cannot import vllm (pip install 'rlgraph[vllm]': the official CUDA wheel)" \
        | tee -a "$OUT/summary.txt"
fi
exit $FAILED
