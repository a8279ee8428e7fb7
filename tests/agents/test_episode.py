"""The episode driver (rlgraph/agents/episode.py): what an environment's step answers enters the
rollout checked, in-process and from worker answers alike (issue 34, items 14-15)."""

from __future__ import annotations

import time

import pytest

import rlgraph as rg
from rlgraph.agents import EnvError, as_token_env
from rlgraph.agents.episode import EnvWarning, start, step_all
from rlgraph.agents.workers import _outcome
from tests.helpers import TOKENIZER


class Answers(rg.Env):
    """Answers `reward` and `observation` on every step (the values under test)."""

    def __init__(self, reward=1.0, observation="ok", limit=None):
        self.reward, self.observation = reward, observation
        if limit is not None:
            self.max_observation_chars = limit

    def reset(self, row):
        return None

    def step(self, action_text):
        return rg.Step(self.observation, reward=self.reward, done=False)


def _episodes(*envs):
    tokens = [as_token_env(env, TOKENIZER) for env in envs]
    return start(tokens, [{}] * len(tokens), budget=64, vocab=len(TOKENIZER))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), 1e308, -2e6])
def test_a_non_finite_or_absurd_step_reward_is_scored_zero_counted_and_named(bad):
    episodes = _episodes(Answers(reward=0.5), Answers(reward=bad))
    with pytest.warns(EnvWarning, match=r"Answers.step \(row 1, turn 0\): Step.reward is .*scored 0.*env/env_errors"):
        step_all(episodes, [[5], [5]], turn=0, timeout_s=5.0, vocab=len(TOKENIZER))
    good, broken = episodes
    assert good.stats["reward"] == 0.5 and good.stats["env_errors"] == 0 and not good.done
    assert broken.stats["reward"] == 0.0 and broken.turn_rewards == [0.0]  # scored 0, as a reward function's is
    assert broken.stats["env_errors"] == 1 and broken.done


@pytest.mark.parametrize("chars, limit", [(20_000_000, None), (1_000_000, None), (100, 50)])
def test_an_oversized_observation_is_refused_fast_counted_and_never_tokenized(chars, limit, monkeypatch):
    calls = []
    monkeypatch.setattr(type(TOKENIZER), "encode", lambda self, *a, **k: calls.append(a) or [5])
    episodes = _episodes(Answers(observation="x" * chars, limit=limit))
    began = time.perf_counter()
    with pytest.warns(EnvWarning, match=r"row 0, turn 0\): its observation has [\d,]+ characters, over "
                                        r"max_observation_chars=[\d,]+"):
        step_all(episodes, [[5]], turn=0, timeout_s=5.0, vocab=len(TOKENIZER))
    assert time.perf_counter() - began < 1.0 and calls == []
    assert episodes[0].stats["env_errors"] == 1 and episodes[0].done and episodes[0].stats["reward"] == 0.0


@pytest.mark.parametrize("limit", [0, -1, "big", True])
def test_a_bad_observation_limit_names_the_attribute(limit):
    with pytest.raises(EnvError, match="max_observation_chars is"):
        _episodes(Answers(limit=limit))[0].env.step([5])


@pytest.mark.parametrize("answer, expected", [
    ({"observation": "ok", "reward": 1.0, "done": False, "info": {"tool_calls": float("nan")}, "seconds": 0.1}, 0.0),
    ({"observation": "ok", "reward": 1.0, "done": False, "info": {}, "seconds": float("nan")}, None),
    ({"observation": "ok", "reward": 1.0, "done": False, "info": {}, "seconds": 99.0}, "timeout"),
])
def test_numbers_of_a_workers_answer_are_checked_where_they_enter(answer, expected):
    """An env worker's JSON answer: non-finite info is not averaged into metrics, a non-finite time is
    replaced by the measured one, and a step whose time with tokenizing passes the timeout is counted."""
    env = as_token_env(Answers(), TOKENIZER)
    step, seconds = _outcome(env, answer, elapsed=0.25, timeout_s=30.0).result()
    episodes = _episodes(Answers())
    from rlgraph.agents.episode import _apply

    if expected == "timeout":
        assert step.info["env_errors"] == 1 and "over the step timeout of 30 s" in step.info["error"]
        return
    assert seconds == pytest.approx(0.1 if expected == 0.0 else 0.25, abs=0.05)
    _apply(episodes[0], step, seconds, "test", len(TOKENIZER))
    assert all(value == value for value in episodes[0].stats.values())  # no NaN in any metric
