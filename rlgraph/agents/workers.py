"""Environments in supervised CPU worker processes (`env.workers`, `rg.compile(env_workers=)`).

    host = EnvWorkers(MyEnv, workers=2, memory_mb=4096)   # MyEnv: a picklable recipe (class, partial)
    envs = host.environments(rows=8, tokenizer=tok)       # one per rollout row, speaking the token protocol
    ...                                                   # rlgraph.agents.episode resets and steps them
    host.close()

Row r's environment lives in worker r % workers (`EnvHost` there builds it from the recipe on each
reset). The episode driver (`rlgraph.agents.episode`) sends the resets, steps and closes of all
rows of a turn at once (`initial_observations`, `step`, `close_all`): a worker gets all its rows'
requests in one write and answers them in order (each with its own timeout), the workers run side
by side. What the controller gets back is JSON (never a
pickle), read by `SupervisedPool`, which also enforces the step timeout and the memory limit.

Failures, and what they become:
  - a step past its timeout (the worker is killed: a C loop, a sleep, SIGSTOP) or a worker that dies
    (a segfault, the memory limit, `os._exit`): the row's episode ends there with reward 0 and
    `env_errors` 1 (`env/env_errors`); the other rows of that worker lose their environment too
    and end the same way (their steps reach the replacement worker, which answers "lost"). The
    run goes on.
  - a step that raises or answers with something other than a `Step`: an `EnvError` naming the row
    and the turn, as in the controller (a bug in the environment, not an accident of its process).
  - a recipe that cannot build in a fresh process: an `EnvError` naming what it raised.
The text protocol's decoding and tokenizing stay in the controller (`TextEnvAdapter`), which holds
the tokenizer: a worker sees the action's text and answers text, exactly as an in-process env does.
"""

from __future__ import annotations

import concurrent.futures
import functools
import pickle
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rlgraph.agents.env import (
    EnvError, ObservationFormat, Step, TextEnvAdapter, as_token_env, build_env, observation_limit, oversized,
)
from rlgraph.supervised.pool import BuildError, PoolNames, SupervisedPool, check_settings

NAMES = PoolNames("env.", "environment", "step_timeout", "an environment's answer")
WORKERS_HINT = "1 or more (null: the environments run in the controller)"


class EnvHost:
    """A worker's side: the environments of the rows it hosts, built from the recipe on each reset."""

    def __init__(self, recipe: bytes):
        self.recipe = pickle.loads(recipe)
        probe = build_env(self.recipe, "the environment recipe")  # what protocol, stop strings, format
        if callable(getattr(probe, "initial_observation", None)):
            self.protocol = "token"
        elif callable(getattr(probe, "reset", None)):
            self.protocol = "text"
        else:
            raise EnvError(f"{type(probe).__name__} is not an environment: it needs reset(row) and step(action_text) "
                           "(rg.Env), or initial_observation(row) and step(action_tokens) (a token env)")
        self.name = type(probe).__name__
        self.stop = [item for item in getattr(probe, "stop", ()) if isinstance(item, str)]
        found = getattr(probe, "observation_format", None)
        self.format = [found.before, found.after] if isinstance(found, ObservationFormat) else None
        self.limit = observation_limit(probe)
        _close(probe)
        self.envs: dict[int, Any] = {}

    def __call__(self, request: tuple) -> dict[str, Any]:
        try:
            return getattr(self, f"_{request[0]}")(*request[1:])
        except Exception as exc:  # the env's own error: the controller names the row and the turn
            from rlgraph.supervised.process import describe_exception

            return {"raised": describe_exception(exc)}

    def _describe(self) -> dict[str, Any]:
        return {"protocol": self.protocol, "name": self.name, "stop": self.stop, "format": self.format,
                "max_observation_chars": self.limit}

    def _reset(self, row: int, data: Mapping[str, Any]) -> dict[str, Any]:
        self._close(row)
        env = self.envs[row] = self.recipe()
        first = env.initial_observation(data) if self.protocol == "token" else env.reset(data)
        return {"observation": first}

    def _step(self, row: int, action: Any) -> dict[str, Any]:
        env = self.envs.get(row)
        if env is None:  # its worker was replaced since the reset
            return {"lost": True}
        started = time.perf_counter()
        step = env.step(action)
        seconds = time.perf_counter() - started
        if not isinstance(step, Step):
            return {"wrong_type": type(step).__name__, "seconds": seconds}
        problem = oversized(step.observation, self.limit)
        if problem is not None:  # never serialized: the worker answers a line, not 20 MB of JSON
            return {"failed": problem}
        if step.image is not None:  # a JSON answer cannot carry it: refused, not silently dropped
            return {"failed": "its step answered with an image, which env worker processes do not carry yet "
                              "(image observations run with env.workers: null, in the generating process)"}
        info = {key: value for key, value in step.info.items()
                if isinstance(value, (int, float)) and not isinstance(value, bool)}  # what metrics read
        return {"observation": step.observation, "reward": step.reward, "done": step.done, "info": info,
                "seconds": seconds}

    def _close(self, row: int) -> dict[str, Any]:
        env = self.envs.pop(row, None)
        if env is not None:
            _close(env)
        return {"closed": True}


def _close(env: Any) -> None:
    close = getattr(env, "close", None)
    if callable(close):
        close()


class RemoteEnv:
    """Row `row`'s environment, living in worker `slot` of `host`. It speaks its recipe's protocol
    (`reset`/`step(text)` or `initial_observation`/`step(ids)`), one call at a time; the episode
    driver batches a turn's calls through `host` instead (`EnvWorkers.step`)."""

    def __init__(self, host: EnvWorkers, row: int, slot: int):
        self.host, self.row, self.slot = host, row, slot
        self.env_name = f"{host.info['name']} (environment worker {slot})"
        self.stop = tuple(host.info["stop"])
        self.max_observation_chars = host.info.get("max_observation_chars")
        before_after = host.info["format"]
        self.observation_format = ObservationFormat(*before_after) if before_after else None
        if host.info["protocol"] == "token":
            self.initial_observation = self._first
        else:
            self.reset = self._first

    def _first(self, row: Mapping[str, Any]) -> Any:
        return self.host.initial_observations([self], [row], timeout_s=None)[0]

    def step(self, action: Any) -> Step:
        return self.host.step([self], [action], timeout_s=None)[0].result()[0]


def remote_of(env: Any) -> RemoteEnv | None:
    """The `RemoteEnv` under `env` (itself, or inside a `TextEnvAdapter`), or None."""
    inner = getattr(env, "env", env)
    return inner if isinstance(inner, RemoteEnv) else None


class EnvWorkers:
    """The environments of an executor's rollouts in `workers` supervised processes (module docstring)."""

    def __init__(self, recipe: Callable[[], Any], workers: int, *, memory_mb: int = 4096, isolation: str = "auto"):
        check_settings(NAMES, workers, memory_mb, workers_hint=WORKERS_HINT)
        try:
            recipe_bytes = pickle.dumps(recipe)
        except Exception as exc:  # a class defined inside a function, a lambda: no worker can rebuild it
            raise EnvError(f"the environment recipe {recipe!r} cannot be sent to environment worker processes: "
                           f"{type(exc).__name__}: {exc}",
                           fix="define the environment class at module level (importable by its module path), or run "
                               "environments in the controller (env.workers: null)") from None
        self.pool = SupervisedPool(functools.partial(EnvHost, recipe_bytes), workers, names=NAMES,
                                   memory_mb=memory_mb, isolation=isolation)
        self.recipe, self.workers, self.memory_mb = recipe, workers, memory_mb
        self._info: dict[str, Any] | None = None

    def describe(self) -> str:
        return self.pool.describe()

    def close(self) -> None:
        self.pool.close()

    @property
    def info(self) -> dict[str, Any]:
        """The recipe's protocol, stop strings and observation format, as a worker found them."""
        if self._info is None:
            (answer,) = self._run([("describe",)], [0], None)
            if "protocol" not in answer:
                raise EnvError(f"an environment worker could not describe the environment: {_problem(answer)}")
            self._info = answer
        return self._info

    def environments(self, rows: int, tokenizer: Any) -> list[Any]:
        """One environment per row, speaking the token protocol (`as_token_env`) as in-process ones do."""
        from rlgraph.agents.env import observation_format

        envs = [RemoteEnv(self, row, row % self.workers) for row in range(rows)]
        return [as_token_env(env, tokenizer, observation_format(env, tokenizer)) for env in envs]

    # -- a turn's calls, all rows at once ---------------------------------------------------------
    def _run(self, requests: Sequence[tuple], slots: Sequence[int], timeout_s: float | None) -> list[dict[str, Any]]:
        try:
            return self.pool.run([pickle.dumps(request) for request in requests], timeout_s, slots=slots,
                                 valid=lambda answer, call: isinstance(answer, dict))
        except BuildError as error:
            raise EnvError(f"an environment worker could not build the environment: {error}",
                           fix="the recipe must build in a fresh process (a module-level class, its module on "
                               "sys.path); check env.memory_mb, or run environments in the controller "
                               "(env.workers: null)") from None

    def initial_observations(self, envs: Sequence[Any], rows: Sequence[Mapping[str, Any]], timeout_s: float | None
                             ) -> list[Any]:
        """Reset every row's environment (a fresh one from the recipe); each first observation, as the
        env's protocol gives it (ids, or ids through the text adapter). A failed reset is an `EnvError`."""
        remotes = [remote_of(env) for env in envs]
        answers = self._run([("reset", remote.row, dict(row)) for remote, row in zip(remotes, rows)],
                            [remote.slot for remote in remotes], timeout_s)
        firsts = []
        for env, remote, answer in zip(envs, remotes, answers):
            if "observation" not in answer:
                raise EnvError(f"the reset of row {remote.row}'s environment (in environment worker {remote.slot}) "
                               f"failed: {_problem(answer)}")
            first = answer["observation"]
            firsts.append(env.first_observation(first) if isinstance(env, TextEnvAdapter) else first)
        return firsts

    def step(self, envs: Sequence[Any], actions: Sequence[list[int]], timeout_s: float | None
             ) -> list[concurrent.futures.Future]:
        """Step every row's environment with its action; for each row a finished future holding
        (Step, seconds) or the `EnvError` its step raised, as the in-process driver's futures do."""
        remotes = [remote_of(env) for env in envs]
        sent = [env.action_text(action) if isinstance(env, TextEnvAdapter)
                else list(action) if isinstance(action, (list, tuple)) else action  # ids, or a text env's own text
                for env, action in zip(envs, actions)]
        started = time.perf_counter()
        answers = self._run([("step", remote.row, action) for remote, action in zip(remotes, sent)],
                            [remote.slot for remote in remotes], timeout_s)
        elapsed = time.perf_counter() - started
        return [_outcome(env, answer, elapsed, timeout_s) for env, answer in zip(envs, answers)]

    def close_all(self, envs: Sequence[Any]) -> None:
        """Close every row's environment; a worker that fails meanwhile is only replaced."""
        remotes = [remote_of(env) for env in envs]
        self._run([("close", remote.row) for remote in remotes], [remote.slot for remote in remotes], 30.0)


def _problem(answer: Mapping[str, Any]) -> str:
    if "failed" in answer:
        return answer["failed"]
    if "raised" in answer:
        return f"raised {answer['raised']}"
    if "unanswerable" in answer:
        return f"answered something JSON cannot carry ({answer['unanswerable']})"
    return f"answered {sorted(answer)}"


def _outcome(env: Any, answer: Mapping[str, Any], elapsed: float, timeout_s: float | None = None
             ) -> concurrent.futures.Future:
    """A worker's answer as the in-process driver's future: what crosses the process boundary is checked
    here (types, finite numbers), and the observation is tokenized within the step's timeout."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    if "failed" in answer or "lost" in answer:  # the process, not the env's code: the episode ends, counted
        problem = answer.get("failed") or "its environment was lost when its worker was killed earlier"
        future.set_result((Step("", 0.0, True, {"env_errors": 1, "error": problem}), elapsed))
    elif "wrong_type" in answer:
        future.set_exception(EnvError(f"returned {answer['wrong_type']}; an environment's step returns "
                                      "rg.Step(observation, reward, done, info)"))
    elif "observation" not in answer:
        future.set_exception(EnvError(_problem(answer)))
    else:
        seconds = answer.get("seconds")
        seconds = float(seconds) if type(seconds) in (int, float) and 0 <= seconds < float("inf") else elapsed
        try:
            step = Step(answer["observation"], answer.get("reward"), bool(answer.get("done")),
                        answer.get("info") if isinstance(answer.get("info"), dict) else {})
        except TypeError as error:
            future.set_exception(EnvError(f"answered {error}"))
            return future
        try:
            began = time.perf_counter()
            step = env.observe(step) if isinstance(env, TextEnvAdapter) else step
            seconds += time.perf_counter() - began  # tokenizing is part of the step, and of its timeout
        except EnvError as error:
            future.set_exception(error)
            return future
        if timeout_s is not None and seconds > timeout_s and not step.info.get("env_errors"):
            step = Step("", 0.0, True, {"env_errors": 1, "error": f"the step and the tokenizing of its observation took "
                                                                  f"{seconds:.1f} s, over the step timeout of {timeout_s:g} s"})
        future.set_result((step, seconds))
    return future
