"""A tiny, seeded, CPU-sized world to run algorithms in tests: models, rewards, prompts.

`tiny_executor()` builds the local executor with the shipped character tokenizer and a small
randomly initialised Qwen2 per model role (a value-head critic for "critic") and `OnesEnv` as the
environment role "env", so a property such as compiled == eager runs in seconds. It is a
`WorldSpec` built in this process: the recipe every runtime builds its roles from. Two calls with
the same arguments build identical workers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rlgraph.agents.env import Step
from rlgraph.backends.local.executor import LocalExecutor
from rlgraph.backends.local.models import load_tokenizer
from rlgraph.backends.world import RoleSpec, WorldSpec
from rlgraph.batches import Prompts
from rlgraph.data import arithmetic
from rlgraph.errors import ConfigError


def length_parity_reward(completions: list[str], **_) -> list[float]:
    """A verifiable reward that varies on an untrained model (exact match is all zeros there)."""
    return [float(len(text) % 2) for text in completions]


class OnesEnv:
    """A tiny two-turn environment for multi-turn tests (`rg.rollout(state.policy, state.env, ...)`):
    after the first turn it answers "7+7", after the second the episode ends with the number of
    "1"s the policy wrote in both turns as its reward (which varies on an untrained model)."""

    def reset(self, row: Mapping[str, Any]) -> None:
        self.turn, self.ones = 0, 0

    def step(self, action_text: str) -> Step:
        self.turn += 1
        self.ones += action_text.count("1")
        done = self.turn >= 2
        return Step("" if done else "7+7", float(self.ones) if done else 0.0, done, {"tool_calls": 1})


def tiny_executor(roles: Sequence[str] = ("policy",), *, seed: int = 0, lr: float = 0.1, optimizer: str = "sgd",
                  critic_lr: float | None = None, reward: Callable[..., list[float]] = length_parity_reward,
                  max_new_tokens: int = 4) -> LocalExecutor:
    """A local executor holding `roles`: "policy" and "critic" train; a teacher role ("teacher",
    "teacher_b", ...) is another frozen model (seeded `seed + 2`: distillation has something to
    learn); any other role (e.g. "ref") is a frozen copy of the initial policy (the usual
    reference model: KL is 0 at the start).

    SGD by default, so a step is exactly the gradient: comparisons between two runs see the
    gradient's differences instead of Adam's normalised signs. The critic is `build_critic`
    seeded `seed + 1`, with `critic_lr` (default `lr`).
    """
    if optimizer not in ("sgd", "adamw"):
        raise ValueError(f"tiny_executor: optimizer must be 'sgd' or 'adamw', got {optimizer!r}")
    specs = {}
    for role in roles:
        if role == "critic":
            specs[role] = RoleSpec(kind="critic", optimizer=optimizer, lr=critic_lr or lr, seed=seed + 1)
        elif role == "policy":
            specs[role] = RoleSpec(optimizer=optimizer, lr=lr, seed=seed)
        else:  # frozen: a teacher of its own, or a copy of the initial policy
            specs[role] = RoleSpec(seed=seed + 2 if role.startswith("teacher") else seed)
    world = WorldSpec(specs, {"reward": reward}, max_new_tokens=max_new_tokens, seed=seed, envs={"env": OnesEnv})
    return world.build_local()


@functools.cache
def _splits(seed: int) -> arithmetic.Splits:
    return arithmetic.make_splits(seed=seed)


def tiny_prompts(count: int = 4, offset: int = 0, *, seed: int = 0) -> Prompts:
    """`count` arithmetic prompts ("12+7=") from the demo task's training split."""
    available = len(_splits(seed).train)
    for name, value, low in (("count", count, 1), ("offset", offset, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"tiny_prompts: {name} must be an int >= {low}, got {value!r}")
    if offset + count > available:  # a slice past the end would quietly return fewer prompts
        raise ConfigError(f"tiny_prompts: offset {offset} + count {count} is past the {available} training prompts")
    return arithmetic.to_prompts(_splits(seed).train[offset:offset + count], _tokenizer())


@functools.cache
def _tokenizer():
    return load_tokenizer()
