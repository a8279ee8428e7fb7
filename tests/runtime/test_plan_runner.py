"""The plan runner against the eager interpreter: same numbers, refill loop included; what it imports."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import rlgraph as rg
from rlgraph.algorithms import dapo
from rlgraph.runtime.runner import EagerRunner
from rlgraph.runtime.plan_runner import PlanRunner
from rlgraph.runtime.worker_pool import WorkerPool
from tests.helpers import make_executor, params_of, prompt_source, prompts

ROOT = Path(rg.__file__).resolve().parent.parent  # the checkout this test imports rlgraph from


def half_dead_reward(completions, text, **_):
    """Prompts starting with an odd digit always score 0 (their groups get dropped); the others
    score the parity of the completion's length, which varies on an untrained model."""
    return [float(len(c) % 2) if int(t[0]) % 2 == 0 else 0.0 for c, t in zip(completions, text)]


def test_dapo_with_dynamic_sampling_runs_the_same_through_the_plan():
    hparams = dict(n=4, max_new_tokens=4, overlong_buffer=1, max_rounds=3)
    results = []
    for runner in ("eager", "plan"):
        executor = make_executor(reward=half_dead_reward)
        worker = executor.models["policy"]
        worker.optimizer = torch.optim.SGD(worker.model.parameters(), lr=0.1)  # the step is the gradient
        if runner == "plan":
            compiled = rg.compile(dapo, mesh="cpu:1", placement=rg.colocated(offload=False, checkpointing=False),
                                  sizes={"B": 4, "P": 8, "T": 4}, **hparams)
            assert "loop: steps 1-" in compiled.as_text()
            stepper = PlanRunner(compiled, executor)
        else:
            stepper = EagerRunner(dapo.trace(**hparams), executor)
        more = prompt_source(4, offset=100)
        metrics = [stepper.run(prompts(4, offset=4 * i), more_prompts=more)[1] for i in range(2)]
        results.append((metrics, params_of(executor)))
    (eager_metrics, eager_params), (plan_metrics, plan_params) = results
    assert max(m["filter/rounds"] for m in eager_metrics) >= 2  # the refill loop ran
    for eager, plan in zip(eager_metrics, plan_metrics):
        assert eager.keys() == plan.keys()
        for key in eager:
            assert plan[key] == pytest.approx(eager[key], rel=1e-5, abs=1e-7), key
    for a, b in zip(eager_params, plan_params):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_over_remote_workers_the_runner_asks_for_the_controllers_executor():
    compiled = rg.compile(dapo, mesh="cpu:1", placement=rg.colocated(offload=False, checkpointing=False),
                          sizes={"B": 4, "P": 8, "T": 4}, n=4, max_new_tokens=4, overlong_buffer=1)
    with pytest.raises(rg.RLGraphError, match=r"pass controller=world.controller\(\)"):
        PlanRunner(compiled, WorkerPool())  # a remote transport's commands, no workers started: nothing is sent


def test_the_runtime_imports_no_compiler_pass():
    """DESIGN.md's layers: `runtime` executes a plan and may import `plan` and `backends`, not `passes`."""
    modules = ["rlgraph.runtime.plan_runner", "rlgraph.runtime.spmd", "rlgraph.runtime.ray_transport",
               "rlgraph.runtime.collectives", "rlgraph.runtime.distributed"]
    code = f"import sys\nfor name in {modules!r}:\n    __import__(name)\n" \
           "print(sorted(m for m in sys.modules if m.startswith('rlgraph.passes')))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert result.stdout.strip() == "[]"


def test_the_moved_names_are_still_importable_from_where_callers_import_them():
    from rlgraph.plan.layouts import CONTROLLER
    from rlgraph.plan.compiled import Compiled
    from rlgraph.plan.layouts import collective_kind
    from rlgraph.plan import compiled, layouts
    from rlgraph.runtime import errors, plan_runner

    assert (Compiled, CONTROLLER, collective_kind) == (compiled.Compiled, layouts.CONTROLLER, layouts.collective_kind)
    assert (plan_runner.WorkerFailure, plan_runner.PlanStepError, plan_runner.PlanInputError) == (
        errors.WorkerFailure, errors.PlanStepError, errors.PlanInputError)


def test_a_non_finite_metric_a_rank_sends_is_named_where_it_enters(monkeypatch):
    """Issue 34: numbers crossing from a rank to the controller are checked for finiteness there. The
    rank's answer is emulated at the transport (`fetch`, what spmd and Ray answer through a pipe or an
    actor call): a NaN loss in the update statistics is named with its role and rank, and kept (the
    same number every runtime reports)."""
    from rlgraph.algorithms import grpo
    from rlgraph.runtime.errors import RankMetricWarning
    from rlgraph.runtime.transport import LocalTransport

    fetch = LocalTransport.fetch

    def nan_loss(self, name, rank):
        value = fetch(self, name, rank)
        return {**value, "loss": torch.tensor(float("nan"))} if isinstance(value, dict) and "loss" in value else value

    monkeypatch.setattr(LocalTransport, "fetch", nan_loss)
    compiled = rg.compile(grpo, mesh="cpu:1", placement=rg.colocated(offload=False, checkpointing=False),
                          sizes={"B": 2, "P": 8, "T": 3}, n=2, max_new_tokens=3)
    runner = PlanRunner(compiled, make_executor(reward=half_dead_reward))
    with pytest.warns(RankMetricWarning, match=r"metric policy/loss=nan: not finite as rank 0 of role 'policy'"):
        _, metrics = runner.run(prompts(2))
    assert metrics["policy/loss"] != metrics["policy/loss"] and metrics["reward"] == metrics["reward"]
