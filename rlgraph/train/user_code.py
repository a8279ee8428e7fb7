"""What a `rlgraph train` config names by string: its rewards, its algorithm and that algorithm's
hyper-parameters, and the user's objects behind `module:name` / `file.py:name`.

Everything here runs in `prepare`, so `rlgraph train --dry-run` refuses a bad entry before any model
is built: a missing file or a misspelt function (with the closest name), a reward that reads a
per-row field the data does not pass, an `eval.accuracy_reward` that names no reward.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import sys
import traceback
from pathlib import Path
from typing import Any

from rlgraph.algorithms import ALGORITHMS
from rlgraph.ir.errors import ConfigError, did_you_mean
from rlgraph.rewards import RewardPipeline, RewardTerm, build_reward, reward_fields
from rlgraph.train.config import TrainConfig


def build_rewards(config: TrainConfig) -> RewardPipeline:
    """The config's reward terms as one pipeline. Before any step: a bad name or option, a missing
    file, or a reward reading a per-row field the data does not pass is a ConfigError naming the
    entry (`rewards[i]`); so is an `eval.accuracy_reward` that names no reward."""
    terms = []
    provided = ["answer", "text", *config.data.extra_fields]  # what every reward call passes (to_prompts' meta)
    for index, reward in enumerate(config.rewards):
        where = f"rewards[{index}] ({reward.name})"
        spec = load_object(reward.name, f"{where}:") if ":" in reward.name else reward.name
        try:
            fn = build_reward(spec, **reward.options)
        except ConfigError as error:
            raise ConfigError(f"{where}: {error.summary}", fix=error.fix) from None
        _check_reward_fields(where, fn, provided)
        terms.append(RewardTerm(reward.name, fn, reward.weight))
    names = [reward.name for reward in config.rewards]
    if config.eval.accuracy_reward is not None and config.eval.accuracy_reward not in names:
        wanted, short = config.eval.accuracy_reward, {name.rpartition(":")[2]: name for name in names}
        hint = did_you_mean(wanted, names) or (f"; did you mean {short[wanted]!r}?" if wanted in short else "")
        raise ConfigError(f"eval.accuracy_reward {wanted!r} is not one of the rewards ({', '.join(names)}){hint}",
                          fix="name one of the rewards entries exactly as written there, or leave it out (the first)")
    return RewardPipeline(terms, on_error=config.reward_on_error, timeout_s=config.reward_timeout_s)


def _check_reward_fields(where: str, fn: Any, provided: list[str]) -> None:
    """A reward must be callable with the per-row fields the data passes: before step 1, not at the first eval."""
    required, accepted = reward_fields(fn)
    missing = [field for field in required if field not in provided]
    if missing:
        extra = [field for field in provided if field not in ("answer", "text")]
        raise ConfigError(f"{where} reads the per-row field(s) {', '.join(missing)}, which the data does not pass "
                          f"(each row passes {', '.join(provided)})",
                          fix=f"add them to data.extra_fields (columns of the data), e.g. "
                              f"extra_fields: [{', '.join([*extra, *missing])}]")
    unaccepted = [field for field in provided if accepted is not None and field not in accepted]
    if unaccepted:
        raise ConfigError(f"{where} does not take the per-row field(s) {', '.join(unaccepted)}, which every call "
                          "passes by keyword", fix="add **_ (or those parameters) to the reward function's parameters")



def algorithm_of(name: str) -> Any:
    if name in ALGORITHMS:
        return ALGORITHMS[name]
    if ":" in name:  # a user's @rg.algorithm: "module:fn" or "file.py:fn"
        return load_object(name, "algorithm.name")
    raise ConfigError(f"algorithm.name {name!r} is not an algorithm{did_you_mean(name, ALGORITHMS)}",
                      fix=f"one of {', '.join(sorted(ALGORITHMS))}, or 'my_module:my_algorithm'")


# Hyper-parameters the rollout section sets (the algorithm's own defaults for them never apply).
ROLLOUT_HPARAMS = ("n", "temperature", "max_new_tokens")


def resolved_hparams(algorithm: str, hparams: dict[str, Any]) -> dict[str, Any]:
    """The algorithm's keyword defaults with `hparams` over them, as the trace binds them: what
    RUN_DIR/config.yaml records, so that a run is read back whole. Defaults that YAML cannot hold
    as written (objects, tuples) stay implicit; the rollout's three are the rollout section's."""
    fn = getattr(algorithm_of(algorithm), "fn", None)
    if fn is None:
        return dict(hparams)
    plain = (type(None), bool, int, float, str)
    defaults = {p.name: p.default for p in inspect.signature(fn).parameters.values()
                if p.kind is p.KEYWORD_ONLY and p.default is not p.empty and isinstance(p.default, plain)
                and p.name not in ROLLOUT_HPARAMS}
    return {**defaults, **hparams}


def with_resolved_hparams(config: TrainConfig) -> TrainConfig:
    algorithm = config.algorithm
    hparams = resolved_hparams(algorithm.name, algorithm.hparams)
    return config.model_copy(update={"algorithm": algorithm.model_copy(update={"hparams": hparams})})


def load_object(spec: str, where: str) -> Any:
    """`module:name` or `path/file.py:name` -> the object (a user's algorithm or reward). A module or
    file that cannot be found, fails to import, or lacks `name` is a ConfigError naming `where`, with
    the closest module, file or name it has when there is one."""
    from rlgraph.cli import import_modules  # the same rules as --import (cwd on the path, .py files)

    module, _, name = spec.rpartition(":")
    try:
        import_modules([module])
    except SystemExit as error:  # the CLI's message names --import; here the config key is what is wrong
        reason, _, fix = str(error).removeprefix("rlgraph: ").split(": ", 1)[-1].partition("; ")
        raise ConfigError(f"{where} {spec!r}: cannot import {module}: {reason}{_closest_module(module)}",
                          fix=fix or None) from None
    except Exception as error:  # the user's module itself raised (a syntax error, a failing import)
        frame = traceback.extract_tb(error.__traceback__)[-1:]
        kind, text = type(error).__name__, str(error)
        at = f" (at {frame[0].filename}:{frame[0].lineno})" if frame else ""
        if isinstance(error, SyntaxError):
            text, at = error.msg, f" (at {error.filename}:{error.lineno})"
        fix = f"fix {module} so that it imports (importing it in python shows the whole traceback)"
        raise ConfigError(f"{where} {spec!r}: importing {module} raised {kind}: {text}{at}", fix=fix) from None
    key = Path(module).stem if module.endswith(".py") else module
    loaded = sys.modules.get(key)
    found = getattr(loaded, name, None)
    if found is None:
        names = [attr for attr, value in vars(loaded).items()  # what the module defines, not what it imports
                 if callable(value) and not attr.startswith("_") and getattr(value, "__module__", None) == loaded.__name__]
        raise ConfigError(f"{where} {spec!r}: {module} has no {name!r}{did_you_mean(name, names)}",
                          fix=f"name a function {module} defines ({', '.join(names[:8]) or 'it defines none'})")
    return found


def _closest_module(module: str) -> str:
    """"; did you mean 'x'?" for a misspelt `.py` path (among its directory's files) or module name
    (among the importable top-level modules and the working directory's files)."""
    if module.endswith(".py"):
        path = Path(module)
        siblings = [str(path.parent / p.name) if str(path.parent) != "." else p.name for p in path.parent.glob("*.py")]
        return did_you_mean(module, siblings)
    head, dot, tail = module.rpartition(".")
    if dot:  # a misspelt submodule: look among its package's modules
        try:
            package = importlib.import_module(head)
            return did_you_mean(module, [f"{head}.{info.name}" for info in pkgutil.iter_modules(package.__path__)])
        except (ImportError, AttributeError):
            return ""
    local = [p.stem for p in Path.cwd().glob("*.py")]
    return did_you_mean(module, [*local, *(info.name for info in pkgutil.iter_modules())])
