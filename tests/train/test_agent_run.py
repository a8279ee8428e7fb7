"""`rlgraph train` with an `env:` section: multi-turn runs, their metrics, and the config's bad inputs."""

from __future__ import annotations

import json
import textwrap

import pytest

from rlgraph.errors import ConfigError
from rlgraph.train.run import train
from rlgraph.train.setup import prepare
from tests.train.test_run import make_config

AGENT = dict(algorithm={"name": "agent_grpo", "hparams": {}}, env={"tools": ["calculator"], "format": "plain"},
             rollout={"max_new_tokens": 16, "max_turns": 2, "max_tokens_per_turn": 8}, warm_start={"steps": 0},
             train={"steps": 2}, eval={"every": 0})


def test_a_tool_env_run_logs_the_episode_metrics_and_evaluates_multi_turn(tmp_path):
    config, _ = make_config(tmp_path, "agent", **AGENT)
    train(config)
    rows = [json.loads(line) for line in (tmp_path / "agent" / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "env/turns" in row]
    assert len(steps) == 2 and all(1.0 <= row["env/turns"] <= 2.0 for row in steps)
    for key in ("env/tool_calls", "env/tool_errors", "env/observation_tokens", "env/budget_cut", "time/env_s_per_step"):
        assert key in steps[0]
    assert rows[0]["step"] == 0 and "eval/accuracy" in rows[0]  # the held-out episodes, greedy, with the env
    assert "rollout" in (tmp_path / "agent" / "plan.txt").read_text()
    # samples.jsonl: each episode's turns (issue 32: 0 lines before), of the training steps and the evaluations
    samples = [json.loads(line) for line in (tmp_path / "agent" / "samples.jsonl").read_text().splitlines()]
    assert {(row["kind"], row["step"]) for row in samples} >= {("eval", 0), ("train", 1), ("train", 2), ("eval", 2)}
    for row in samples:
        roles = [turn["role"] for turn in row["turns"]]
        assert roles[0] == "policy" and all(a != b for a, b in zip(roles, roles[1:]))  # turns alternate
        assert roles.count("policy") == row["episode"]["turns"]  # the calculator always answers something
        assert row["reward"] == sum(turn.get("reward", 0.0) for turn in row["turns"])  # the env's, summed over turns


def test_a_users_env_class_is_loaded_with_its_options(tmp_path):
    source = tmp_path / "my_env.py"
    source.write_text(textwrap.dedent('''
        import rlgraph as rg

        class Guess:
            def __init__(self, bonus):
                self.bonus = bonus
            def reset(self, row):
                self.answer = row["answer"]
            def step(self, text):
                return rg.Step("", float(text.strip() == self.answer) + self.bonus, True)
    '''))
    config, _ = make_config(tmp_path, "user", **{**AGENT, "env": {"path": f"{source}:Guess", "options": {"bonus": 0.5}}})
    setup = prepare(config)
    env = setup.env()
    env.reset({"answer": "3"})
    assert env.step("3").reward == 1.5
    bad, _ = make_config(tmp_path, "bad", **{**AGENT, "env": {"path": f"{source}:Guess", "options": {"bonus": 1, "x": 2}}})
    with pytest.raises(ConfigError, match="env.path .* with env.options .*unexpected keyword argument 'x'"):
        prepare(bad)


@pytest.mark.parametrize("sections, message", [
    ({"env": {"tools": ["calculater"], "format": "plain"}}, "env.tools\\[0\\] 'calculater' is not a built-in tool; did you mean 'calculator'"),
    ({"env": {"tools": ["calculator"], "path": "x.py:Env"}}, "exactly one of them"),
    ({"env": {"tools": [], "format": "plain"}}, "exactly one of them"),
    ({"env": {"tools": ["calculator"], "format": "xml"}}, "env.format"),
    ({"env": {"tools": [{"name": "search", "options": {"corpus": []}}]}}, "env.tools: search tool: corpus must be a non-empty list"),
    ({"env": None}, "runs multi-turn episodes \\(rg.rollout\\) but the config has no env: section"),
    ({"algorithm": {"name": "grpo"}, "rollout": {"max_new_tokens": 4}}, "has an env: section but algorithm 'grpo' never steps it"),
    *[({"env": {"tools": ["calculator"], "workers": value}}, "env.workers") for value in (0, "2", 1.5)],
    *[({"env": {"tools": ["calculator"], "memory_mb": value}}, "env.memory_mb") for value in (512, "4096", None)],
    ({"rollout": {"max_turns": 0}}, "rollout.max_turns"),
    ({"rollout": {"step_timeout": -1}}, "rollout.step_timeout"),
])
def test_a_bad_env_config_is_refused_naming_the_key(tmp_path, sections, message):
    with pytest.raises(ConfigError, match=message):
        config, _ = make_config(tmp_path, "bad", **{**AGENT, **sections})
        prepare(config)


def test_env_workers_reach_the_plan(tmp_path):
    config, _ = make_config(tmp_path, "workers", **{**AGENT, "env": {"tools": ["calculator"], "workers": 2,
                                                                     "memory_mb": 2048}})
    setup = prepare(config)
    for plan in (setup.rl, setup.eval):  # the run's, and the held-out episodes'
        assert "in 2 env worker processes per generating rank (2048 MiB each" in plan.as_text()


def test_max_turns_with_a_single_turn_algorithm_is_refused(tmp_path):
    config, _ = make_config(tmp_path, "single", rollout={"max_turns": 3})
    with pytest.raises(ConfigError, match="rollout.max_turns=3, but the algorithm 'grpo' takes no 'max_turns'"):
        prepare(config)


def test_a_warm_start_on_tool_use_traces_trains_the_policy_turns(tmp_path):
    rows = [{"question": f"{a}*{b}=", "answer": str(a * b),
             "trace": [f"<tool>calculator({a}*{b})</tool>", str(a * b), str(a * b)]} for a in range(2, 6) for b in range(2, 6)]
    data = tmp_path / "traces.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config, _ = make_config(tmp_path, "traced", **{**AGENT, "data": {"train": str(data), "extra_fields": ["trace"]},
                                                   "warm_start": {"steps": 2, "batch_size": 8, "trace_field": "trace"},
                                                   "train": {"steps": 1}})
    train(config)
    rows = [json.loads(line) for line in (tmp_path / "traced" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["warm_start/steps"] == 2.0
    untraced, _ = make_config(tmp_path, "untraced", **{**AGENT, "warm_start": {"steps": 1, "trace_field": "trace"}})
    with pytest.raises(ConfigError, match="no trace field 'trace'"):
        train(untraced)
