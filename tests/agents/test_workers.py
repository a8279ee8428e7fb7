"""Environments in supervised worker processes (`rlgraph/agents/workers.py`, `env_workers`): the same
episodes as in the controller, a hanging step and a dying worker survived and counted, bad settings
named, and the plan saying where env steps run.

The environments live in tests/agents/workers_envs.py (module level: the workers import them). Tests
that start worker processes (a few s each) are marked slow."""

import time

import pytest
import torch

import rlgraph as rg
from rlgraph.agents.env import EnvError
from rlgraph.agents.workers import EnvWorkers
from rlgraph.algorithms import agent_grpo
from rlgraph.backends.protocols import EnvRef
from rlgraph.errors import ConfigError
from rlgraph.runtime.plan_runner import PlanRunner
from rlgraph.testing import tiny_executor, tiny_prompts
from tests.agents import workers_envs as envs
from tests.helpers import assert_same_metrics

ERRORS, SECONDS, TURNS = (rg.EPISODE_FIELDS.index(name) for name in ("env_errors", "env_seconds", "turns"))
NOT_TIME = [k for k in range(len(rg.EPISODE_FIELDS)) if k != SECONDS]  # env_seconds is wall-clock


def run(executor, env, prompts, **options):
    executor.envs["env"] = env
    settings = dict(n=2, max_turns=3, max_tokens_per_turn=4, max_total_tokens=30) | options
    return executor.rollout(executor.current("policy"), EnvRef("env"), prompts, **settings)


@pytest.mark.slow
@pytest.mark.parametrize("env", [envs.Countdown, envs.CountTokens])
def test_workers_give_the_episodes_the_controller_gives(env):
    """A deterministic env (text, and token protocol): the same ids, masks, log-probs, turn rewards and
    statistics, bit for bit (the same model, the same sampling counters: only where env.step runs differs)."""
    here = run(tiny_executor(), env, tiny_prompts(2))
    executor = tiny_executor()
    try:
        away = run(executor, env, tiny_prompts(2), env_workers=2)
        # one row's environment called on its own (the protocol's methods, one round trip each), as the driver does
        (alone,), (local,) = executor.env_workers["env"].environments(1, executor.tokenizer), [executor._environment(EnvRef("env"))]
        assert alone.initial_observation({"text": "1+2="}) == local.initial_observation({"text": "1+2="})
        assert alone.step([5, 6]) == local.step([5, 6])
    finally:
        executor.env_workers["env"].close()
    for name in ("response_ids", "mask", "context_mask", "logprobs"):
        assert torch.equal(getattr(here[0], name), getattr(away[0], name)), name
    assert torch.equal(here[1][:, NOT_TIME], away[1][:, NOT_TIME]) and torch.equal(here[2], away[2])
    assert here[1][:, TURNS].sum() > len(here[0]) and away[1][:, ERRORS].sum() == 0


@pytest.mark.slow
@pytest.mark.parametrize("workers, errors, turns", [
    (3, [1.0, 1.0, 0.0], [2.0, 2.0, 3.0]),  # one episode per worker: only the two accidents end
    (1, [1.0, 1.0, 1.0], [2.0, 2.0, 2.0]),  # one worker: the steps queued behind the hang find their env gone
])
def test_a_hanging_step_and_a_dying_worker_end_their_episodes_counted(workers, errors, turns):
    """Three episodes: on turn 2 the first hangs (killed at the 1 s timeout) and the second kills its
    own process; they end there, counted in env_errors, and so does any episode whose env lived in a
    killed worker; the others play their 3 turns. The run returns."""
    executor = tiny_executor()
    started = time.perf_counter()
    try:
        ro, episodes, _ = run(executor, envs.Accidents, tiny_prompts(3), n=1, env_workers=workers, step_timeout=1.0)
    finally:
        executor.env_workers["env"].close()
    assert time.perf_counter() - started < 120  # not the 600 s of the hung step (worker starts: a few s each)
    assert episodes[:, ERRORS].tolist() == errors
    assert episodes[:, TURNS].tolist() == turns  # the failed step is the second turn's
    assert (ro.mask.sum(1) > 0).all()


def test_a_nan_reward_and_a_20_mb_observation_from_a_worker_end_their_episodes_counted_and_named():
    """Issue 34, items 14-15, both sides of the worker boundary without starting a process (~10 s
    each under load): the worker's `EnvHost` refuses a 20 MB observation before serializing it, and
    its JSON answer (NaN travels in JSON) enters the controller checked: both episodes end scored 0,
    counted in env_errors and named."""
    import json
    import pickle

    from rlgraph.agents.episode import Episode, EnvWarning, _apply
    from rlgraph.agents.env import as_token_env
    from rlgraph.agents.workers import EnvHost, _outcome
    from tests.helpers import TOKENIZER

    host = EnvHost(pickle.dumps(envs.Floods))
    answers = {}
    for row, text in enumerate(["14+94=", "83+63=", "1+1="]):
        host._reset(row, {"text": text})
        host._step(row, "1")
        answers[row] = json.loads(json.dumps(host._step(row, "1")))  # the second turn, as the channel carries it
    assert answers[1] == {"failed": answers[1]["failed"]} and "20,000,000 characters" in answers[1]["failed"]
    env = as_token_env(envs.Floods(), TOKENIZER)
    episodes = [Episode(env, row, 64) for row in range(3)]
    with pytest.warns(EnvWarning) as caught:
        for row, episode in enumerate(episodes):
            step, seconds = _outcome(env, answers[row], elapsed=0.01, timeout_s=30.0).result()
            _apply(episode, step, seconds, f"Floods.step (row {row}, turn 1)", len(TOKENIZER))
    messages = " | ".join(str(w.message) for w in caught)
    assert "(row 0, turn 1): Step.reward is nan (not finite)" in messages
    assert "(row 1, turn 1): its observation has 20,000,000 characters, over max_observation_chars=16,384" in messages
    assert [episode.stats["env_errors"] for episode in episodes] == [1.0, 1.0, 0.0]
    assert [episode.stats["reward"] for episode in episodes][:2] == [0.0, 0.0]


@pytest.mark.slow
@pytest.mark.parametrize("env, message", [
    (envs.Raises, r"Raises \(environment worker 0\)\.step \(row 0, turn 0\): raised ValueError: no such move"),
    (envs.WrongType, r"returned str; an environment's step returns rg\.Step"),
])
def test_an_env_that_raises_or_answers_a_wrong_type_in_a_worker_is_named(env, message):
    executor = tiny_executor()
    try:
        with pytest.raises(EnvError, match=message):
            run(executor, env, tiny_prompts(1), env_workers=1)
    finally:
        executor.env_workers["env"].close()


@pytest.mark.slow
def test_a_recipe_that_cannot_be_sent_or_built_is_named():
    class Local(envs.Countdown):  # defined in a function: no worker can import it
        pass

    with pytest.raises(EnvError, match="(?s)cannot be sent to environment worker processes.*define the environment class "
                                       "at module level"):
        EnvWorkers(Local, 1)
    host = EnvWorkers(envs.broken_recipe, 1, memory_mb=1200)
    with pytest.raises(EnvError, match="could not build the environment: ImportError: no module named my_envs"):
        host.environments(2, tiny_executor().tokenizer)
    host.close()


@pytest.mark.parametrize("option, values", [("env_workers", [0, -1, "2", True, 1.5]),
                                            ("env_memory_mb", [512, 1.5e3, None])])
def test_bad_env_worker_settings_are_refused_naming_them(option, values):
    for value in values:
        with pytest.raises(ConfigError, match=f"{option}={value!r} is not a whole number"):
            rg.compile(agent_grpo, sizes={"B": 2, "P": 8, "T": 20}, **{"env_workers": 2, option: value})
    for value in values[:3]:  # the executor's pool refuses them too, named as the config spells them
        name = option.replace("env_", "env.")
        with pytest.raises(ConfigError, match=f"{name}={value!r} must be a whole number"):
            EnvWorkers(envs.Countdown, **({"workers": 2, "memory_mb": 4096} | {option.removeprefix("env_"): value}))


def test_env_workers_for_an_algorithm_without_environments_are_refused():
    from rlgraph.algorithms import grpo

    with pytest.raises(ConfigError, match="env_workers=2 but grpo never calls rg.rollout"):
        rg.compile(grpo, sizes={"B": 2, "P": 8, "T": 8}, env_workers=2)


HPARAMS = dict(n=2, max_turns=3, max_tokens_per_turn=4, max_total_tokens=30)


def compiled(**options):
    return rg.compile(agent_grpo, sizes={"B": 2, "P": 8, "T": 30}, **HPARAMS, **options)


def test_the_plan_says_where_env_steps_run():
    here, away = compiled(), compiled(env_workers=2, env_memory_mb=2048, step_timeout=5)
    assert "between turns env 'env'.step per row in the generating rank's process, concurrently" in here.as_text()
    assert ("between turns env 'env'.step per row in 2 env worker processes per generating rank (2048 MiB each; a step "
            "past the timeout or a dead worker ends the episode, counted in env/env_errors), concurrently, timeout 5 s"
            ) in away.as_text()
    (node,) = [node for node in away.program.graph.nodes if node.name == "rollout"]
    assert node.meta["env_workers"] == {"env_workers": 2, "env_memory_mb": 2048}  # what the runtime hands the executor


@pytest.mark.slow
def test_the_runner_steps_the_envs_where_the_plan_says():
    here, away = compiled(), compiled(env_workers=2, env_memory_mb=2048, step_timeout=5)
    local, remote = tiny_executor(), tiny_executor()
    local.envs["env"] = remote.envs["env"] = envs.Countdown
    try:
        expected = PlanRunner(here, local).run(tiny_prompts(2))[1]
        got = PlanRunner(away, remote).run(tiny_prompts(2))[1]
        host = remote.env_workers["env"]
        assert (host.workers, host.memory_mb, len(host.pool.pids())) == (2, 2048, 2)  # what the plan said ran
    finally:
        remote.env_workers["env"].close()
    assert "env" not in local.env_workers and got["env/env_errors"] == 0.0
    assert_same_metrics(expected, got)
