"""The user's code, by name: `--import` modules, `module:fn` / `file.py:fn` objects, algorithms, and
what a `rlgraph train` config names by string (its rewards, its algorithm's hyper-parameters).

    import_modules(["my_estimators", "rewards.py"], "--import")   # their registrations run
    load_object("my_rewards.py:exact", "rewards[0].name")         # -> the function
    load_algorithm("grpo", "algorithm.name")                      # a built-in, or "my_algos.py:my_grpo"
    build_rewards(config)                                         # the config's reward pipeline, checked

Every mistake is a `ConfigError` naming `where` (the CLI flag or the config key), with the closest
name when there is one, and the fix. Module names are also looked up in the working directory, as
`python -m` would. `rlgraph train` calls these in `prepare`, so `--dry-run` refuses a bad entry
before any model is built: a missing file or a misspelt function, a reward that reads a per-row
field the data does not pass, an `eval.accuracy_reward` that names no reward.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import os
import pkgutil
import sys
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from rlgraph.errors import ConfigError, did_you_mean
from rlgraph.rewards import RewardPipeline, RewardTerm, build_reward, reward_fields
from rlgraph.rewards.reward_pool import default_workers
from rlgraph.train.config import TrainConfig
from rlgraph.user_files import import_file


def import_modules(names: Sequence[str], where: str = "--import") -> None:
    """Import each of `names`, a dotted module name or a path to a .py file, for its registrations.
    A module that cannot be found is a ConfigError; errors raised by the module itself propagate."""
    for name in names:
        try:
            if name.endswith(".py"):
                import_file(Path(name))
            else:
                with _working_directory_on_path():
                    importlib.import_module(name)
        except (ModuleNotFoundError, FileNotFoundError) as exc:
            raise ConfigError(f"{where} {name}: {exc}",
                              fix="run rlgraph from the directory that holds it, pass the path of the .py file, "
                                  "or add its directory to PYTHONPATH") from None


@contextlib.contextmanager
def _working_directory_on_path() -> Iterator[None]:
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added:
            sys.path.remove(cwd)


def load_object(spec: str, where: str) -> Any:
    """`module:name` or `path/file.py:name` -> the object (a user's algorithm or reward). A module or
    file that cannot be found, fails to import, or lacks `name` is a ConfigError naming `where`, with
    the closest module, file or name it has when there is one."""
    module, _, name = spec.rpartition(":")
    if not module or not name.isidentifier():
        raise ConfigError(f"{where} {spec!r} is not 'module:name' or 'file.py:name'",
                          fix="e.g. my_module:my_function or path/to/file.py:my_function")
    try:
        import_modules([module], f"{where} {spec!r}: cannot import")
    except ConfigError as error:
        raise ConfigError(f"{error.summary}{_closest_module(module)}", fix=error.fix) from None
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


def load_algorithm(name: str, where: str) -> Any:
    """A built-in algorithm's name (rlgraph list algorithms) or a user's `@rg.algorithm` as
    `module:fn` / `file.py:fn` -> the `Algorithm`."""
    from rlgraph.algorithms import ALGORITHMS
    from rlgraph.api import Algorithm

    if name in ALGORITHMS:
        return ALGORITHMS[name]
    if ":" not in name:
        raise ConfigError(f"{where} {name!r} is not an algorithm{did_you_mean(name, ALGORITHMS)}",
                          fix=f"one of {', '.join(sorted(ALGORITHMS))} (rlgraph list), or your own as "
                              "my_module:my_algorithm or my_file.py:my_algorithm")
    found = load_object(name, where)
    if not isinstance(found, Algorithm):
        raise ConfigError(f"{where} {name!r} is a {type(found).__name__}, not an algorithm",
                          fix="decorate the function with @rg.algorithm (import rlgraph as rg)")
    return found


def build_rewards(config: TrainConfig) -> RewardPipeline:
    """The config's reward terms as one pipeline. Before any step: a bad name or option, a missing
    file, or a reward reading a per-row field the data does not pass is a ConfigError naming the
    entry (`rewards[i]`); so is an `eval.accuracy_reward` that names no reward. The terms run in
    `reward_workers` processes, each rebuilding them from the config (`reward_functions`)."""
    workers = default_workers() if config.reward_workers is None else config.reward_workers
    return RewardPipeline(_reward_terms(config), on_error=config.reward_on_error, timeout_s=config.reward_timeout_s,
                          samples=config.logging.samples, workers=workers,
                          recipe=functools.partial(reward_functions, config), memory_mb=config.reward_memory_mb,
                          isolation=config.reward_isolation)


def reward_functions(config: TrainConfig) -> list[Any]:
    """The config's reward functions, built in a reward worker process as `build_rewards` built them."""
    import_modules(config.imports, "imports")
    return [term.fn for term in _reward_terms(config)]


# the pipeline's own metrics beside the terms': a term of that name would overwrite them
_PIPELINE_METRICS = ("errors",)


def reward_metric_names(names: Sequence[str]) -> list[str]:
    """Each reward entry's metric name (`reward/<name>`): the function's name, so a metric does not
    change when its file moves (`rewards/mine.py:exact` -> `exact`); on a clash (two files' `score`,
    a function named like a built-in or `errors`) `<file stem>:<fn>`, and the entry as written if
    that clashes too."""
    def short(name: str) -> str:
        return name.rpartition(":")[2]

    def stem(name: str) -> str:
        module, _, fn = name.rpartition(":")
        return f"{Path(module).stem if module.endswith('.py') else module.rpartition('.')[2]}:{fn}" if module else name

    shorts = [short(name) for name in names]
    out = []
    for name in names:
        if ":" in name and shorts.count(short(name)) == 1 and short(name) not in _PIPELINE_METRICS:
            out.append(short(name))
        elif ":" in name and [stem(other) for other in names].count(stem(name)) == 1:
            out.append(stem(name))
        else:
            out.append(name)
    return out


def accuracy_metric(config: TrainConfig) -> str:
    """The metric name of the reward entry `eval.accuracy_reward` names (default: the first)."""
    names = [reward.name for reward in config.rewards]
    return reward_metric_names(names)[names.index(config.accuracy_reward)]


def _reward_terms(config: TrainConfig) -> list[RewardTerm]:
    terms = []
    provided = ["answer", "text", *config.data.extra_fields]  # what every reward call passes (to_prompts' meta)
    metric_names = reward_metric_names([reward.name for reward in config.rewards])
    for index, reward in enumerate(config.rewards):
        where = f"rewards[{index}] ({reward.name})"
        spec = load_object(reward.name, f"{where}:") if ":" in reward.name else reward.name
        try:
            fn = build_reward(spec, **reward.options)
        except ConfigError as error:
            raise ConfigError(f"{where}: {error.summary}", fix=error.fix) from None
        _check_reward_fields(where, fn, provided)
        terms.append(RewardTerm(metric_names[index], fn, reward.weight))
    names = [reward.name for reward in config.rewards]
    if config.eval.accuracy_reward is not None and config.eval.accuracy_reward not in names:
        wanted, short = config.eval.accuracy_reward, {name.rpartition(":")[2]: name for name in names}
        hint = did_you_mean(wanted, names) or (f"; did you mean {short[wanted]!r}?" if wanted in short else "")
        raise ConfigError(f"eval.accuracy_reward {wanted!r} is not one of the rewards ({', '.join(names)}){hint}",
                          fix="name one of the rewards entries exactly as written there, or leave it out (the first)")
    return terms


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


# Hyper-parameters the rollout section sets (the algorithm's own defaults for them never apply).
ROLLOUT_HPARAMS = ("n", "temperature", "top_p", "max_new_tokens", "stop", "max_turns", "max_tokens_per_turn",
                   "step_timeout")


def resolved_hparams(algorithm: str, hparams: dict[str, Any]) -> dict[str, Any]:
    """The algorithm's keyword defaults with `hparams` over them, as the trace binds them: what
    RUN_DIR/config.yaml records, so that a run is read back whole. Defaults that YAML cannot hold
    as written (objects, tuples) stay implicit; the rollout's keys are the rollout section's."""
    fn = getattr(load_algorithm(algorithm, "algorithm.name"), "fn", None)
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


def build_env(config: TrainConfig) -> Any:
    """The `env:` section as a picklable environment recipe (None without one): a built-in tool
    environment, its final answers scored by the first reward term, or the user's class with its
    options. Built once here, so a bad tool name, option or class is a ConfigError before any step."""
    section = config.env
    if section is None:
        return None
    if section.path is not None:
        import functools

        cls = load_object(section.path, "env.path")
        recipe = functools.partial(cls, **section.options)
        _try_build(recipe, f"env.path {section.path!r} with env.options {section.options}")
        return recipe
    from rlgraph.agents.tool_env import ScoreAnswer, ToolEnvRecipe
    from rlgraph.agents.tools import BUILTIN_TOOLS

    tools = []
    for index, tool in enumerate(section.tools):
        if tool.name not in BUILTIN_TOOLS:
            raise ConfigError(f"env.tools[{index}] {tool.name!r} is not a built-in tool{did_you_mean(tool.name, BUILTIN_TOOLS)}",
                              fix=f"one of {', '.join(BUILTIN_TOOLS)}; for your own tools write an environment "
                                  "(env.path: file.py:MyEnv) that returns rg.ToolEnv([...]) from its class")
        tools.append((tool.name, tuple(sorted(tool.options.items()))))
    first = config.rewards[0]
    spec = load_object(first.name, "rewards[0]:") if ":" in first.name else first.name
    recipe = ToolEnvRecipe(tuple(tools), section.format, ScoreAnswer(build_reward(spec, **first.options)),
                           section.max_calls)
    _try_build(recipe, "env.tools")
    return recipe


def _try_build(recipe: Any, where: str) -> None:
    try:
        recipe()
    except ConfigError as error:
        raise ConfigError(f"{where}: {error.summary}", fix=error.fix) from None
    except TypeError as error:  # an option the tool or class does not take
        raise ConfigError(f"{where}: {error}", fix="pass only the keyword arguments it takes") from None
