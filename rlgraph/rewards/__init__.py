"""Reward functions: plain `fn(completions: list[str], **meta) -> list[float]`, one score per completion.

`meta` holds the rollouts' per-row fields (`answer`, `text` = the prompt, and the data's
`extra_fields`); a reward takes the fields it needs by name and ignores the rest.

    build_reward("math")                                   the built-ins, by name (below)
    build_reward("format_regex", pattern=r"\\d+$")         options checked when built
    build_reward(my_fn, scale=2.0)                         your own function or class, options bound
    RewardPipeline([RewardTerm(...), ...], on_error=...)   several terms, weights, a failure policy

Built-ins: exact_match, math (`\\boxed{}`, `####`, last number; 0.5 == 1/2), format_regex, tags,
code (tests run in a sandboxed subprocess), reward_model (a sequence-classification model).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from rlgraph.errors import ConfigError, RewardError, did_you_mean
from rlgraph.rewards.code_exec import CodeTests
from rlgraph.rewards.combine import RewardPipeline, RewardTerm
from rlgraph.rewards.formats import FormatRegex, Tags
from rlgraph.rewards.math_answers import answers_equal, extract_answer, math_reward
from rlgraph.rewards.reward_model import RewardModel
from rlgraph.rewards.verifiable import RewardFn, exact_match

BUILTIN: dict[str, Callable[..., Any]] = {
    "exact_match": exact_match,
    "math": math_reward,
    "format_regex": FormatRegex,
    "tags": Tags,
    "code": CodeTests,
    "reward_model": RewardModel,
}

# Parameters a reward receives per call (from the rollouts), never as build options.
_PER_CALL = {"completions", "answer", "text", "self"}


def build_reward(spec: str | Callable[..., Any], **options: Any) -> RewardFn:
    """The reward `spec` names (a built-in) or is (a function or class), with `options` bound.

    A class is instantiated with the options; a function gets them as keyword arguments on every
    call. An option the reward does not take is a ConfigError naming it and the ones it takes.
    """
    if isinstance(spec, str):
        if spec not in BUILTIN:
            raise ConfigError(f"unknown reward {spec!r}{did_you_mean(spec, BUILTIN)}; built-in rewards: "
                              f"{', '.join(BUILTIN)}",
                              fix="name a built-in, or your own function as 'module:function' or 'path/file.py:function'")
        name, target = spec, BUILTIN[spec]
    elif callable(spec):
        name, target = getattr(spec, "__name__", repr(spec)), spec
    else:
        raise ConfigError(f"a reward is a name or a callable, not {type(spec).__name__} {spec!r}")
    _check_options(name, target, options)
    if inspect.isclass(target):
        try:
            return target(**options)
        except TypeError as exc:
            raise ConfigError(f"reward {name!r}: {exc}") from None
    return functools.partial(target, **options) if options else target


def reward_fields(fn: Callable[..., Any]) -> tuple[list[str], list[str] | None]:
    """(the per-row fields `fn` cannot be called without, the fields it accepts or None for any).

    Required: its `fields` attribute (a class reading a configured field, as `code` reads `tests`)
    and its parameters after the completions without a default. Accepted: its named parameters,
    or anything with `**meta`. Checked against the data before a run starts (`rlgraph train --dry-run`).
    """
    required = list(getattr(fn, "fields", ()))
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return required, None  # a C callable: nothing to read
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    positional = [p for p in params
                  if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    rest = [p for p in params if p.kind in named and not (positional and p is positional[0])]  # after `completions`
    required += [p.name for p in rest if p.default is inspect.Parameter.empty and p.name not in required]
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    return required, None if takes_any else [p.name for p in rest]


def _check_options(name: str, target: Callable[..., Any], options: dict[str, Any]) -> None:
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return  # a builtin or C callable: nothing to check against
    params = signature.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()) and not inspect.isclass(target) \
            and target not in BUILTIN.values():
        return  # a user function taking **kwargs accepts anything
    takes = [p for p, param in params.items() if p not in _PER_CALL and param.kind in
             (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for option in options:
        if option not in takes:
            raise ConfigError(f"reward {name!r} has no option {option!r}{did_you_mean(option, takes)}; "
                              f"its options: {', '.join(takes) or 'none'}")
    if inspect.isclass(target):
        missing = [p for p in takes if params[p].default is inspect.Parameter.empty and p not in options]
        if missing:
            raise ConfigError(f"reward {name!r} needs the option(s) {', '.join(missing)}",
                              fix=f"write e.g. {{name: {name}, options: {{{missing[0]}: ...}}}}")


__all__ = ["BUILTIN", "CodeTests", "FormatRegex", "RewardError", "RewardFn", "RewardModel", "RewardPipeline",
           "RewardTerm", "Tags", "answers_equal", "build_reward", "exact_match", "extract_answer", "math_reward",
           "reward_fields"]
