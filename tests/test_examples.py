"""Every example in examples/ runs (shortened where it trains)."""

from __future__ import annotations

import json
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def in_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # the example configs name their data relative to the project root


def test_plan_70b_ppo_fits_after_the_refused_placement(capsys):
    compiled = load("plan_70b_ppo").main()
    out = capsys.readouterr().out
    assert "refused" in out and "memory per rank" in out
    assert all(max(p["total"] for p in phases.values()) < 80 * 2**30 for phases in compiled.memory_analysis().values())


def test_property_test_loss_example():
    module = load("property_test_loss")
    module.test_token_mean_loss_is_microbatch_invariant()
    module.test_sequence_mean_loss_is_caught()


@pytest.mark.slow
def test_custom_estimator_example():
    assert load("custom_estimator").main(steps=2)["steps"] == 2


@pytest.mark.slow
def test_custom_reward_example():
    assert load("custom_reward").main(steps=2)["steps"] == 2


@pytest.mark.slow
def test_math_grpo_example_runs_from_the_command_line(tmp_path):
    """The README's command, shortened: a run directory with metrics, plan, checkpoints and plots."""
    run_dir = tmp_path / "math"
    done = subprocess.run(
        [sys.executable, "-m", "rlgraph", "train", "examples/math_grpo/config.yaml", "-o", f"run_dir={run_dir}",
         "-o", "train.steps=2", "-o", "warm_start.steps=4", "-o", "rollout.prompts_per_step=4", "-o", "eval.max_prompts=8",
         "-o", "logging.progress=false", "-o", "runtime.threads=1"],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for name in ("metrics.jsonl", "plan.txt", "config.yaml", "plots/reward.png", "tensorboard"):
        assert (run_dir / name).exists(), name
    assert list(run_dir.glob("step-*"))


@pytest.mark.slow
def test_math_grpo_example_raises_held_out_accuracy(tmp_path, monkeypatch):
    """The example as shipped (warm start to 30%), 100 of its 400 RL steps: greedy held-out accuracy rises."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the torch kernels, as `rlgraph train` runs on CPU (interpreted Triton: 10x slower)
    from rlgraph.train.config import load_config
    from rlgraph.train.run import train

    config = load_config(ROOT / "examples/math_grpo/config.yaml",
                         [f"run_dir={tmp_path / 'math'}", "train.steps=100", "eval.every=0", "logging.progress=false",
                          "logging.plots=false", "logging.tensorboard=false",
                          "runtime.threads=1"])  # the example's 2 threads would fight the other test worker
    result = train(config)
    assert result.eval_before >= 0.25                       # the warm start reached its target
    assert result.eval_after >= result.eval_before + 0.08   # measured: 0.33 -> 0.495 at step 100 (2 threads)


@pytest.mark.slow
def test_calculator_agent_example_runs_multi_turn_from_the_command_line(tmp_path):
    """The agent example, shortened: a warm start on tool-use traces, then multi-turn GRPO steps that
    call the calculator (env/tool_calls) and read its answer back; its plan shows the rollout stage."""
    run_dir = tmp_path / "agent"
    done = subprocess.run(
        [sys.executable, "-m", "rlgraph", "train", "examples/calculator_agent/config.yaml", "-o", f"run_dir={run_dir}",
         "-o", "train.steps=2", "-o", "warm_start.steps=6", "-o", "warm_start.target_accuracy=null",
         "-o", "rollout.prompts_per_step=4", "-o", "eval.max_prompts=8", "-o", "logging.progress=false",
         "-o", "runtime.threads=1"],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["warm_start/steps"] == 6.0
    steps = [row for row in rows if "env/turns" in row]
    assert len(steps) == 2 and all(row["env/turns"] >= 1.0 for row in steps)
    assert "between turns env 'env'.step" in (run_dir / "plan.txt").read_text()


@pytest.mark.slow
def test_calculator_agent_example_raises_held_out_accuracy(tmp_path, monkeypatch):
    """The agent example as shipped (warm start on traces to 30%), 20 of its 100 GRPO steps on
    multi-turn episodes, on one thread: greedy held-out accuracy (100 problems) rises by more than
    8 points. Measured on one thread (2026-11-28; held-out at steps 0/10/20/30/40): seed 0
    51/59/66/67/69 (+15 at step 20), seed 1 69/76/80/80/82 (+11), seed 2 32/60/55/63/65 (+23); the
    example's two threads, seed 0: 34 -> 58 (+24) at step 100. The warm start stops at its first
    check at or above 30%, so the base lands anywhere in 32-69%; a high base has less to gain. The
    bound keeps 3 points (3 problems) of margin on the worst seed at step 20; the test's seed 0 (51 ->
    66, re-measured 2026-12-02) clears it by 7. 20 steps, not 40: the suite's time budget (the warm
    start, 145 SFT steps and their checks, is half the test either way)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    from rlgraph.train.config import load_config
    from rlgraph.train.run import train

    config = load_config(ROOT / "examples/calculator_agent/config.yaml",
                         [f"run_dir={tmp_path / 'agent'}", "train.steps=20", "eval.every=0", "logging.progress=false",
                          "logging.plots=false", "logging.tensorboard=false",
                          "runtime.threads=1"])  # the example's 2 threads would fight the other test worker
    result = train(config)
    assert result.eval_before >= 0.25                      # the warm start reached its target
    assert result.eval_after >= result.eval_before + 0.08  # seed 0 on one thread: 0.51 -> 0.66


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["warm", "config"])
def test_distill_example_stages_run(tmp_path, stage):
    """examples/distill, shortened: each student stage for 2 steps against a saved random teacher (the
    figures of the full example are in docs/benchmarks.md)."""
    from rlgraph.backends.local.models import build_causal_lm, load_tokenizer
    from rlgraph.train.config import load_config
    from rlgraph.train.run import train

    tokenizer = load_tokenizer()
    build_causal_lm(tokenizer=tokenizer, seed=3).save_pretrained(tmp_path / "teacher")
    tokenizer.save_pretrained(tmp_path / "teacher")
    config = load_config(ROOT / "examples" / "distill" / f"{stage}.yaml", [
        f"run_dir={tmp_path / 'run'}", f"model.teachers.teacher={tmp_path / 'teacher'}", "model.path=examples/distill/student.json",
        "train.steps=2", "rollout.prompts_per_step=4", "eval.max_prompts=8", "logging.plots=false"])
    train(config)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum("policy/grad_norm" in row for row in rows) == 2


def test_the_vapo_and_pretrain_example_configs_load():
    """Their configs load and the VAPO hyper-parameters trace (training them: tests/train/test_pretraining.py,
    tests/algorithms/test_vapo.py; their figures: docs/benchmarks.md)."""
    from rlgraph.algorithms import vapo
    from rlgraph.train.config import load_config

    vapo_config = load_config(ROOT / "examples/vapo/config.yaml")
    assert "decoupled_gae" in str(vapo.trace(**vapo_config.algorithm.hparams, n=vapo_config.rollout.n))
    pretrain_config = load_config(ROOT / "examples/pretrain/config.yaml")
    assert pretrain_config.algorithm.name == "pretrain" and not pretrain_config.rewards
    assert len(list((ROOT / pretrain_config.data.train).glob("*.txt"))) == 8


def test_the_vision_example_data_is_what_make_data_draws(tmp_path, monkeypatch):
    """examples/vision_shapes: the shipped data files are make_data.py's output (the run below, and
    tests/train/test_vision.py on the same drawings, read them)."""
    spec = importlib.util.spec_from_file_location("vision_make_data", ROOT / "examples/vision_shapes/make_data.py")
    make_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_data)
    monkeypatch.setattr(make_data, "HERE", tmp_path)
    make_data.main()
    for name in ("train.jsonl", "test.jsonl"):
        assert (tmp_path / name).read_text() == (ROOT / "examples/vision_shapes" / name).read_text()


@pytest.mark.slow
def test_the_vision_example_raises_held_out_accuracy(tmp_path, monkeypatch):
    """examples/vision_shapes as shipped (warm start to 40%, 100 GRPO steps at temperature 0.7, one
    thread): greedy held-out accuracy on its 200 images rises by 10 points or more, and the plan counts
    the images. Measured 2026-12-02 on the loaded 2-core machine, held-out at steps 0/25/50/75/100:
    seed 0 47.5/65.5/71/69.5/72.5 (+25), seed 1 56/54/63.5/71/74 (+18), seed 2 58/48.5/69/80.5/93.5
    (+35.5). The worst seed's +18 leaves 8 points over the asserted 10 (the test runs seed 0: 15); at
    step 50 seed 1 had only +7.5, so the test runs the example's 100 steps, not fewer."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the torch kernels, as `rlgraph train` runs on CPU (interpreted: 10x slower)
    from rlgraph.train.config import load_config
    from rlgraph.train.run import train

    run_dir = tmp_path / "vision"
    config = load_config(ROOT / "examples/vision_shapes/config.yaml",
                         [f"run_dir={run_dir}", "eval.every=0", "logging.progress=false", "logging.samples=0"])
    result = train(config)
    assert result.eval_before >= 0.40                       # the warm start reached its target
    assert result.eval_after >= result.eval_before + 0.10   # seed 0: 0.475 -> 0.725
    assert "pixel budget 256 px an image -> <= 4 image tokens" in (run_dir / "plan.txt").read_text()
