"""Runners: what the trainer steps. The eager one is the reference interpreter bound to one program."""

import pytest
import torch

import rlgraph as rg
from rlgraph.algorithms import grpo
from rlgraph.runtime.eager import Interpreter
from rlgraph.runtime.plan_runner import PlanRunner
from rlgraph.runtime.runner import EagerRunner, Runner
from tests.helpers import make_executor, params_of, parity_reward, prompts


def test_an_eager_runner_is_the_interpreter_on_its_program_step_for_step():
    program = grpo.trace(n=2, max_new_tokens=3)
    runner, interpreter = EagerRunner(program, make_executor(reward=parity_reward)), Interpreter(make_executor(reward=parity_reward))
    for step in range(2):
        batch = prompts(2, offset=2 * step)
        (state, metrics), (expected_state, expected) = runner.run(batch), interpreter.run(program, batch)
        assert state == expected_state and metrics == expected
    assert all(torch.equal(a, b) for a, b in zip(params_of(runner.interpreter.executor), params_of(interpreter.executor)))
    runner.carried = {"kl_coef": torch.tensor(0.5)}  # what a resume puts back is what the next step reads
    assert runner.interpreter.carried["kl_coef"].item() == 0.5


def test_a_synchronous_runner_saves_no_batches_in_flight_and_refuses_a_checkpoint_that_holds_some():
    compiled = rg.compile(grpo, mesh="cpu:1", placement=rg.colocated(offload=False), sizes={"B": 2, "P": 8, "T": 3},
                          n=2, max_new_tokens=3)
    for runner in (EagerRunner(compiled.source, make_executor()), PlanRunner(compiled, make_executor())):
        assert isinstance(runner, Runner) and runner.export_in_flight() is None
        runner.import_in_flight(None, "step-2")  # nothing saved: nothing to do
        runner.import_in_flight({"batches_issued": 0, "in_flight": []}, "step-2")
        with pytest.raises(rg.RLGraphError, match=r"step-2 holds 1 batch\(es\) in flight .* but this plan is synchronous"):
            runner.import_in_flight({"batches_issued": 3, "in_flight": [{"slot": 0}]}, "step-2")
