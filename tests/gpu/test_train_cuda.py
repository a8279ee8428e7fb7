"""`rlgraph train` on a CUDA device: the math example shortened, full weights and LoRA, and resume.

UNTESTED: written on a machine without a GPU; these tests skip there. What they check on a GPU:
every step is logged and every logged number is finite, a run resumed on CUDA continues from
its checkpoint, and the export (fp32 weights, as the executor keeps its masters while computing
in bf16 autocast) loads in transformers on the CPU.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from rlgraph.train.config import load_config
from rlgraph.train.run import load_run_config, train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ROOT = Path(__file__).resolve().parents[2]


def shortened(run_dir: Path, *overrides: str):
    return load_config(ROOT / "examples/math_grpo/config.yaml", [
        f"run_dir={run_dir}", "runtime.device=cuda", "train.steps=4", "warm_start.steps=20",
        "warm_start.target_accuracy=null", "eval.every=2", "eval.max_prompts=32", "checkpoint.every=2",
        "logging.progress=false", "logging.plots=false", *overrides])


def finite_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        bad = {k: v for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, (row["step"], bad)
    return rows


@pytest.mark.parametrize("lora", [None, "{r: 8, target_modules: [q_proj, v_proj]}"])
def test_a_short_run_on_cuda_resumes_and_exports(tmp_path, monkeypatch, lora):
    monkeypatch.chdir(ROOT)
    extra = [f"model.lora={lora}"] if lora else []
    result = train(shortened(tmp_path / "run", *extra))
    assert result.steps == 4
    rows = finite_rows(tmp_path / "run")
    assert [row["step"] for row in rows if "reward" in row] == [1, 2, 3, 4]
    resumed = train(load_run_config(tmp_path / "run", ["train.steps=6"]), resume=True)
    assert resumed.steps == 6
    finite_rows(tmp_path / "run")

    from transformers import AutoModelForCausalLM

    from rlgraph.train.export import export_run

    out = export_run(tmp_path / "run", tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in model.parameters())
