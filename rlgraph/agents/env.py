"""Environments: what a multi-turn rollout talks to between the policy's turns.

Two protocols, one driver. A *text* environment (`Env`) sees what the policy wrote, decoded, and
answers with text; a *token* environment (`TokenEnv`, the shape of tinker-cookbook's `Env`) sees
the sampled ids and answers with ids. The rollout driver speaks only the token protocol: a text
environment is wrapped once (`TextEnvAdapter`), which decodes each action and tokenizes each
observation exactly once, so the trajectory is built from ids and never re-tokenized.

    class Guess(rg.Env):                        # a user's environment
        def reset(self, row):                   # row: the prompt's data row (its meta fields)
            self.answer = row["answer"]
        def step(self, action_text):
            right = action_text.strip() == self.answer
            return rg.Step("" if right else "try again", reward=float(right), done=right)

An environment is built per rollout row from a picklable *recipe* (`factory()`: the class, or a
`functools.partial` of it), on the process of the rank that generates the row.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs

from rlgraph.errors import RLGraphError


class EnvError(RLGraphError, ValueError):
    """An environment broke its protocol: `step` raised, timed out, or returned something other
    than a `Step`; the message names the environment, the row and the turn, and `fix` what to do."""

    def __init__(self, message: str, fix: str | None = None):
        self.summary, self.fix = message, fix
        super().__init__(message + (f"\n  fix: {fix}" if fix else ""))


MAX_OBSERVATION_CHARS = 16_384  # an env's `max_observation_chars` default; tokenizing grows faster than linearly (docs/security.md)


def observation_limit(env: Any) -> int:
    """The characters (a text env) or ids (a token env) one observation may have: the env's own
    `max_observation_chars` attribute, or MAX_OBSERVATION_CHARS. A longer one is never tokenized."""
    limit = getattr(env, "max_observation_chars", MAX_OBSERVATION_CHARS)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise EnvError(f"{type(env).__name__}.max_observation_chars is {limit!r}; it must be a whole number >= 1",
                       fix=f"set it to the longest observation the environment may answer (default {MAX_OBSERVATION_CHARS:,})")
    return limit


def oversized(observation: Any, limit: int) -> str | None:
    """What is wrong with an observation over `limit` characters or ids, or None (checked before any tokenizing)."""
    if isinstance(observation, (str, list)) and len(observation) > limit:
        unit = "characters" if isinstance(observation, str) else "token ids"
        return (f"its observation has {len(observation):,} {unit}, over max_observation_chars={limit:,} (an attribute "
                "of the environment class); it is not tokenized, the episode ends scored 0")
    return None


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"Step.reward must be a number, got {type(value).__name__} {value!r}")
    return float(value)


@attrs.frozen
class Step:
    """What an environment answers to one action.

    `observation`: text (a text env) or token ids (a token env) given to the policy before its
    next turn ("" or [] for none); `reward`: this turn's reward (the episode's reward is the sum);
    `done`: the episode ends here; `info`: anything to log (numbers are averaged into metrics);
    `image`: a PIL image shown before the observation (a vision-language policy only, docs/vlm.md).
    """

    observation: Any = ""
    reward: float = attrs.field(default=0.0, converter=_number)
    done: bool = False
    info: Mapping[str, Any] = attrs.field(factory=dict)
    image: Any = None


@runtime_checkable
class Env(Protocol):
    """A text environment: `reset(row)` starts an episode from a data row (a dict of the prompt's
    fields) and may return a first observation (text appended after the prompt, or None);
    `step(action_text)` answers one policy turn. `close()` is optional."""

    def reset(self, row: Mapping[str, Any]) -> str | None: ...

    def step(self, action_text: str) -> Step: ...


@runtime_checkable
class TokenEnv(Protocol):
    """A token environment: `initial_observation(row)` -> ids appended after the prompt (may be
    empty); `step(action_tokens)` -> a `Step` whose observation is a list of token ids. Unlike
    tinker-cookbook's `Env`, the row is passed in: one recipe serves every row of the data."""

    def initial_observation(self, row: Mapping[str, Any]) -> list[int]: ...

    def step(self, action_tokens: list[int]) -> Step: ...


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


@attrs.frozen
class ObservationFormat:
    """How an observation's text becomes the ids of a turn between two policy turns:
    `before + text + after`, tokenized once. `before` closes the policy's turn and opens the
    environment's (the chat template's turn markers); `after` closes it and opens the next
    policy turn. Without a chat template both are newlines."""

    before: str = "\n"
    after: str = "\n"

    @staticmethod
    def from_chat_template(tokenizer: Any, role: str = "tool") -> ObservationFormat:
        """The markers a chat template puts around a `role` message that follows an assistant turn,
        found by rendering the conversation with sentinels once; the plain newlines when the
        tokenizer has no template or the template drops the sentinels."""
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            return ObservationFormat()
        said, answer = "\x00ACTION\x00", "\x00OBSERVATION\x00"
        messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": said},
                    {"role": role, "content": answer}]
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template without this role: the plain markers
            return ObservationFormat()
        if said not in text or answer not in text:
            return ObservationFormat()
        between = text.split(said, 1)[1]
        before, after = between.split(answer, 1)
        return ObservationFormat(before, after)


class TextEnvAdapter:
    """A text `Env` seen as a `TokenEnv`: decodes each action once, tokenizes each observation once
    (`format.before + text + format.after`, no special tokens added)."""

    def __init__(self, env: Any, tokenizer: Tokenizer, format: ObservationFormat | None = None) -> None:
        self.env, self.tokenizer = env, tokenizer
        self.format = format or ObservationFormat.from_chat_template(tokenizer)

    def initial_observation(self, row: Mapping[str, Any]) -> list[int]:
        return self.first_observation(self.env.reset(row))

    def first_observation(self, text: Any) -> list[int]:
        """The ids of what `reset` returned (None or "": none)."""
        if text is None or text == "":
            return []
        if not isinstance(text, str):
            raise EnvError(f"{type(self.env).__name__}.reset returned {type(text).__name__}; a text env's reset "
                           "returns the first observation's text or None")
        problem = oversized(text, observation_limit(self.env))
        if problem is not None:
            raise EnvError(f"{type(self.env).__name__}.reset: {problem}",
                           fix="answer a shorter first observation, or raise max_observation_chars on the env class")
        return self.encode(text)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(self.format.before + text + self.format.after, add_special_tokens=False))

    def step(self, action_tokens: list[int]) -> Step:
        return self.observe(self.env.step(self.action_text(action_tokens)))

    def action_text(self, action_tokens: list[int]) -> str:
        return self.tokenizer.decode(action_tokens, skip_special_tokens=True)

    def observe(self, step: Any) -> Any:
        """The text env's answer with its observation tokenized (anything but a `Step` passes as is)."""
        if not isinstance(step, Step):
            return step  # the driver names the wrong type, with the row and turn
        if not isinstance(step.observation, str):
            raise EnvError(f"{type(self.env).__name__}.step returned an observation of type "
                           f"{type(step.observation).__name__}; a text env answers with text")
        problem = oversized(step.observation, observation_limit(self.env))
        if problem is not None:  # refused before tokenizing: a 20 MB answer costs a len(), not minutes
            return Step("", 0.0, True, {"env_errors": 1, "error": problem})
        observation = self.encode(step.observation) if step.observation and not step.done else []
        return attrs.evolve(step, observation=observation)

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            close()


class OpenEnvAdapter:
    """An OpenEnv-style environment (`reset() -> result`, `step(action) -> result`, where a result
    has `.observation`, `.reward`, `.done`) as a text `Env`.

    `make_action(text)` builds the env's action object from the policy's text; `render(observation)`
    turns its observation object into text (default `str`). The row is ignored by OpenEnv's reset.
    """

    def __init__(self, env: Any, make_action: Callable[[str], Any], render: Callable[[Any], str] = str) -> None:
        self.env, self.make_action, self.render = env, make_action, render

    def reset(self, row: Mapping[str, Any]) -> str | None:
        result = self.env.reset()
        observation = getattr(result, "observation", None)
        return None if observation is None else self.render(observation)

    def step(self, action_text: str) -> Step:
        result = self.env.step(self.make_action(action_text))
        missing = [name for name in ("observation", "reward", "done") if not hasattr(result, name)]
        if missing:
            raise EnvError(f"OpenEnvAdapter: {type(self.env).__name__}.step returned {type(result).__name__} without "
                           f"{', '.join(missing)}; an OpenEnv step result has observation, reward and done")
        observation = "" if result.observation is None else self.render(result.observation)
        return Step(observation, float(result.reward or 0.0), bool(result.done))

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            close()


def as_token_env(env: Any, tokenizer: Tokenizer, format: ObservationFormat | None = None) -> Any:
    """`env` speaking the token protocol: a `TokenEnv` as is, a text `Env` through `TextEnvAdapter`."""
    if callable(getattr(env, "initial_observation", None)) and callable(getattr(env, "step", None)):
        return env
    if callable(getattr(env, "reset", None)) and callable(getattr(env, "step", None)):
        return TextEnvAdapter(env, tokenizer, format)
    raise EnvError(f"{type(env).__name__} is not an environment: it needs reset(row) and step(action_text) "
                   "(rg.Env), or initial_observation(row) and step(action_tokens) (a token env)")


def observation_format(env: Any, tokenizer: Any) -> ObservationFormat | None:
    """The markers around `env`'s observations: the chat template's when it puts any text around a
    tool message, else the environment's own (`env.observation_format`), else None (newlines)."""
    template = ObservationFormat.from_chat_template(tokenizer)
    if template.before.strip() or template.after.strip():
        return template
    return getattr(env, "observation_format", None)


def build_env(recipe: Callable[[], Any], where: str) -> Any:
    """One fresh environment from its recipe, refusing a recipe that is not callable or builds nothing."""
    if not callable(recipe):
        raise EnvError(f"{where}: the environment recipe must be callable (a class or functools.partial), "
                       f"got {type(recipe).__name__}")
    return recipe()
