"""`rlgraph.train.session`: on the local runtime too, the warm start and every evaluation are runs
of compiled plans by the plan runner, step for step as the plans print them (issue 35)."""

from __future__ import annotations

import re

import pytest

from rlgraph.runtime.eager import Interpreter
from rlgraph.runtime.transport import LocalTransport
from rlgraph.train.run import Run
from tests.train.test_run import make_config

STEP_LINE = re.compile(r"^  \[(\d+)\] (.+)$")


def printed_steps(compiled) -> dict[int, str]:
    """Step index -> its first printed line, read from the plan's text (`as_text`), not its objects."""
    section = compiled.as_text().split("\nsteps:\n", 1)[1].split("\nmemory per rank", 1)[0]
    return {int(match[1]): match[2] for line in section.splitlines() if (match := STEP_LINE.match(line))}


def test_a_local_runs_warm_start_and_evaluations_run_the_steps_their_plans_print(tmp_path, monkeypatch):
    executed: dict[int, list] = {}  # id(transport) -> the plan steps it was driven through, in order
    at_step = LocalTransport.at_step

    def recorded(self, step):
        executed.setdefault(id(self), []).append(step)
        return at_step(self, step)

    monkeypatch.setattr(LocalTransport, "at_step", recorded)
    monkeypatch.setattr(Interpreter, "run", lambda *_, **__: pytest.fail("a program ran on the eager interpreter"))
    config, _ = make_config(tmp_path, "plans", ["train.steps=1", "warm_start.steps=2", "warm_start.eval_every=1",
                                                "warm_start.target_accuracy=1.0", "eval.every=0"])
    with Run(config) as run:
        session = run.session
        sft, warm_eval = session.warm_runners
        # two SFT steps, each followed by the target's evaluation; then the step-0 evaluation of the RL start
        runners = {"sft": (sft, 2), "warm_start eval": (warm_eval, 2), "eval": (session.eval_runner, 1)}
        assert sft.compiled is session.setup.warm and sft.compiled.plan.algorithm == "sft"
        assert warm_eval.compiled is session.setup.eval is session.eval_runner.compiled  # compiled once
        for what, (runner, runs) in runners.items():
            printed = printed_steps(runner.compiled)
            assert printed, what
            steps = executed.get(id(runner.transport), [])
            assert [printed[step.index] for step in steps] == list(printed.values()) * runs, what
            assert all(step is runner.compiled.plan.steps[step.index] for step in steps), what
