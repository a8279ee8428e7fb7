"""One multi-turn episode per rollout row, kept as token ids, and the batch they become.

Token in, token out: a row's response is the concatenation, in order, of the ids the policy
sampled (mask True, with their sampling log-probs) and the ids of each observation as the
environment's adapter tokenized it once (mask False, log-prob 0, `context_mask` True). Nothing
is decoded and re-encoded on the way to the trainer: the ids trained on are the ids sampled.

Environment steps of a turn run concurrently across rows (a thread pool), each bounded by the
rollout's step timeout. A step that raises, hangs or answers with something that is not a `Step`
stops the run with an `EnvError` naming the row, the turn and the environment (as a failing
reward does); tool failures inside a `ToolEnv` are observations for the model, not errors.
"""

from __future__ import annotations

import concurrent.futures
import math
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from rlgraph.agents.env import EnvError, Step
from rlgraph.agents.workers import remote_of
from rlgraph.ir.primitives import EPISODE_FIELDS

_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="rlgraph-env")


@attrs.define
class Episode:
    """Row `row`'s episode: its environment (token protocol) and its response so far."""

    env: Any
    row: int
    budget: int  # response tokens, all turns: the rollout's max_total_tokens (T)
    ids: list[int] = attrs.field(factory=list)
    policy: list[bool] = attrs.field(factory=list)
    logprobs: list[float] = attrs.field(factory=list)
    turn_ends: list[int] = attrs.field(factory=list)  # response index of each turn's last policy token
    turn_rewards: list[float] = attrs.field(factory=list)
    done: bool = False
    budget_cut: bool = False
    stats: dict[str, float] = attrs.field(factory=lambda: dict.fromkeys(EPISODE_FIELDS, 0.0))
    # a vision-language policy's image encoder: image -> (its tokens, pixels [k, D], grid [3]); None: a text policy
    show: Any = None
    images: list = attrs.field(factory=list)  # (pixels, grid) of each image observation, in order

    @property
    def remaining(self) -> int:
        return self.budget - len(self.ids)

    def add_policy(self, tokens: Sequence[int], logprobs: Sequence[float]) -> None:
        self.ids += tokens
        self.policy += [True] * len(tokens)
        self.logprobs += logprobs
        self.turn_ends.append(len(self.ids) - 1)
        self.stats["turns"] += 1

    def add_observation(self, tokens: Sequence[int], image: Any = None) -> list[int]:
        """Append the observation's ids (cut to the budget, which ends the episode); the ids appended.
        With `image` ((pixels, grid) whose tokens `tokens` holds), an observation that does not fit is
        dropped whole: a cut image would leave tokens without their features."""
        room = self.remaining - 1  # at least one policy token must follow an observation
        if len(tokens) > room:
            tokens = list(tokens[: max(room, 0)]) if image is None else []
            self.done, self.budget_cut = True, True
            self.stats["budget_cut"] = 1.0
        elif image is not None:
            self.images.append(image)
        self.ids += tokens
        self.policy += [False] * len(tokens)
        self.logprobs += [0.0] * len(tokens)
        self.stats["observation_tokens"] += len(tokens)
        return list(tokens) if not self.done else []


def _env_name(env: Any) -> str:
    inner = getattr(env, "env", env)  # the text env inside an adapter
    return getattr(inner, "env_name", None) or type(inner).__name__  # env_name: a worker's env (agents.workers)


def _host(envs: Sequence[Any]) -> Any:
    """The `EnvWorkers` whose processes hold these environments (None: they live here). Its envs'
    calls go to it as one batch per turn, so the workers run side by side."""
    remote = remote_of(envs[0]) if envs else None
    return None if remote is None else remote.host


def start(envs: Sequence[Any], rows: Sequence[Mapping[str, Any]], budget: int, vocab: int,
          timeout_s: float | None = None) -> list[Episode]:
    """One episode per (env, row); an initial observation goes first in the response, as context."""
    host = _host(envs)
    firsts = host.initial_observations(envs, rows, timeout_s) if host is not None else None
    episodes = []
    for index, (env, row) in enumerate(zip(envs, rows)):
        episode = Episode(env, index, budget)
        first = firsts[index] if firsts is not None else env.initial_observation(row)
        _check_ids(first, vocab, f"{_env_name(env)}.reset/initial_observation of row {index}")
        if len(first) >= budget:
            raise EnvError(f"the first observation of row {index} ({_env_name(env)}) has {len(first)} tokens, the "
                           f"whole response budget max_total_tokens={budget}; no policy token would fit")
        episode.add_observation(first)
        episodes.append(episode)
    return episodes


def _check_ids(ids: Any, vocab: int, where: str) -> None:
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise EnvError(f"{where}: a token env's observation must be a list of token ids, got {type(ids).__name__}")
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise EnvError(f"{where}: observation ids {bad[:5]} are outside the vocabulary 0..{vocab - 1}")


def step_all(episodes: Sequence[Episode], actions: Sequence[list[int]], *, turn: int, timeout_s: float | None,
             vocab: int) -> list[list[int]]:
    """Step every episode's env with its action (concurrently); the observation ids each appended."""
    started = time.perf_counter()
    host = _host([episode.env for episode in episodes])
    if host is not None:  # in worker processes: they enforce the timeout; the futures come back finished
        futures = host.step([episode.env for episode in episodes], actions, timeout_s)
    else:
        futures = [_POOL.submit(_timed_step, episode.env, action) for episode, action in zip(episodes, actions)]
    observations = []
    for episode, future in zip(episodes, futures):
        name = _env_name(episode.env)
        where = f"{name}.step (row {episode.row}, turn {turn})"
        left = None if timeout_s is None else max(0.0, timeout_s - (time.perf_counter() - started))
        try:
            step, seconds = future.result(timeout=left)
        except concurrent.futures.TimeoutError:
            raise EnvError(f"{where} did not return within the step timeout of {timeout_s:g} s",
                           fix="make the step faster, or raise rg.rollout(step_timeout=...) (None lifts it)") from None
        except EnvError as error:
            raise EnvError(f"{where}: {error.summary}", error.fix) from None
        except Exception as error:
            raise EnvError(f"{where} raised {type(error).__name__}: {error}",
                           fix="fix the environment (the exception's traceback is chained below); a tool's failure "
                               "inside a ToolEnv becomes an observation instead") from error
        if not isinstance(step, Step):
            raise EnvError(f"{where} returned {type(step).__name__}; an environment's step returns "
                           "rg.Step(observation, reward, done, info)")
        observations.append(_apply(episode, step, seconds, where, vocab))
    return observations


def _timed_step(env: Any, action: list[int]) -> tuple[Any, float]:
    started = time.perf_counter()
    return env.step(action), time.perf_counter() - started


def _apply(episode: Episode, step: Step, seconds: float, where: str, vocab: int) -> list[int]:
    problem = _reward_problem(step.reward) or step.info.get("error")
    if problem is not None and (step.info.get("env_errors") or _reward_problem(step.reward)):
        # as a reward function's failure is: the sample scored 0, counted, named; the run goes on
        warnings.warn(f"{where}: {problem}; counted in env/env_errors", EnvWarning, stacklevel=2)
        step = Step("", 0.0, True, {"env_errors": 1})
        episode.turn_rewards = [0.0] * len(episode.turn_rewards)
        episode.stats["reward"] = 0.0
    episode.turn_rewards.append(step.reward)
    episode.stats["reward"] += step.reward
    episode.stats["env_seconds"] += seconds if math.isfinite(seconds) and seconds >= 0 else 0.0
    for key in ("tool_calls", "tool_errors", "tool_truncated", "env_errors"):
        value = step.info.get(key, 0)
        finite = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        episode.stats[key] += float(value) if finite else 0.0
    if step.done:
        episode.done = True
        return []
    _check_ids(step.observation, vocab, where)
    if getattr(step, "image", None) is None:
        return episode.add_observation(step.observation)
    if episode.show is None:
        raise EnvError(f"{where} answered with an image, but the policy reads no images (a text model)",
                       fix="train a vision-language policy (the vision: section), or answer with text")
    tokens, pixels, grid = episode.show(step.image)  # the image's own tokens, then the observation's
    return episode.add_observation([*tokens, *step.observation], image=(pixels, grid))


MAX_ABS_REWARD = 1e6  # a step reward beyond this is a bug, not a task: sums and group statistics overflow float32


class EnvWarning(UserWarning):
    """An environment's step was scored 0 and counted in env/env_errors; the message names the env, the row, the turn."""


def _reward_problem(reward: float) -> str | None:
    """Why a step reward cannot be trained on (not finite, or absurdly large), or None."""
    if not math.isfinite(reward):
        return f"Step.reward is {reward} (not finite); the episode is scored 0"
    if abs(reward) > MAX_ABS_REWARD:
        return f"Step.reward is {reward:g}, beyond +-{MAX_ABS_REWARD:g}; the episode is scored 0"
    return None


def close_all(episodes: Sequence[Episode]) -> None:
    host = _host([episode.env for episode in episodes])
    if host is not None:
        host.close_all([episode.env for episode in episodes])
        return
    for episode in episodes:
        close = getattr(episode.env, "close", None)
        if callable(close):
            close()


def to_tensors(episodes: Sequence[Episode], steps: int, pad_id: int) -> dict[str, torch.Tensor]:
    """The episodes as right-padded tensors of `steps` columns: response_ids, mask (policy tokens),
    context_mask (every real token), logprobs, turn_rewards (each turn's reward at its last policy
    token) and the per-episode statistics [N, len(EPISODE_FIELDS)]."""
    rows = len(episodes)
    ids = torch.full((rows, steps), pad_id, dtype=torch.long)  # [N, T]
    mask = torch.zeros(rows, steps, dtype=torch.bool)  # [N, T]
    context = torch.zeros(rows, steps, dtype=torch.bool)  # [N, T]
    logprobs = torch.zeros(rows, steps)  # [N, T]
    turn_rewards = torch.zeros(rows, steps)  # [N, T]
    for row, episode in enumerate(episodes):
        length = len(episode.ids)
        ids[row, :length] = torch.tensor(episode.ids, dtype=torch.long)
        mask[row, :length] = torch.tensor(episode.policy, dtype=torch.bool)
        context[row, :length] = True
        logprobs[row, :length] = torch.tensor(episode.logprobs, dtype=torch.float32)
        for end, reward in zip(episode.turn_ends, episode.turn_rewards):
            turn_rewards[row, end] += reward
    stats = torch.tensor([[episode.stats[name] for name in EPISODE_FIELDS] for episode in episodes],
                         dtype=torch.float32).reshape(rows, len(EPISODE_FIELDS))  # [N, E]
    return dict(response_ids=ids, mask=mask, context_mask=context, logprobs=logprobs, turn_rewards=turn_rewards,
                stats=stats)
