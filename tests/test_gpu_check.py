"""tools/gpu_check.sh: its CPU-safe part (`--smoke`) runs here; the GPU part is run by whoever has a GPU.

Smoke mode runs the environment report, every kernel benchmark code path on tiny shapes (the GPU
tables through TRITON_INTERPRET=1) and the collection of tests/gpu, so a broken import or benchmark
is found before a GPU hour is spent on it.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu_check.sh"


@pytest.mark.slow
def test_the_smoke_mode_of_the_gpu_check_passes_and_writes_its_summary(tmp_path):
    out = tmp_path / "check"
    result = subprocess.run(["bash", str(SCRIPT), "--smoke", str(out)], capture_output=True, text=True,
                            env={**os.environ, "PYTHON": sys.executable}, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line.split()[:2] for line in (out / "summary.txt").read_text().splitlines()]
    assert rows == [["environment", "ok"], ["kernels-smoke", "ok"], ["gpu-tests-collect", "ok"]]
    assert "rlgraph from " + str(ROOT / "rlgraph") in (out / "environment.log").read_text()


def test_a_failing_step_is_counted_and_the_others_still_run(tmp_path):
    """The script's step runner, checked on a copy whose python fails: every step is FAILED, exit = count."""
    out = tmp_path / "check"
    result = subprocess.run(["bash", str(SCRIPT), "--smoke", str(out)], capture_output=True, text=True,
                            env={**os.environ, "PYTHON": "false"}, timeout=120)
    assert result.returncode == 3
    assert [line.split()[1] for line in (out / "summary.txt").read_text().splitlines()] == ["FAILED"] * 3


def test_the_full_check_names_every_gpu_path():
    text = SCRIPT.read_text()
    for step in ("gpu-tests", "demo-cuda", "train-local-cuda", "train-spmd-nccl", "kernels"):
        assert f"step {step} " in text, step
