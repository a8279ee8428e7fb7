"""The user's code, by name: `--import` modules, `module:fn` / `file.py:fn` objects, algorithms.

    import_modules(["my_estimators", "rewards.py"], "--import")   # their registrations run
    load_object("my_rewards.py:exact", "rewards[0].name")         # -> the function
    load_algorithm("grpo", "algorithm.name")                      # a built-in, or "my_algos.py:my_grpo"

Every mistake is a `ConfigError` naming `where` (the CLI flag or the config key) and the fix.
Module names are also looked up in the working directory, as `python -m` would.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from rlgraph.ir.errors import ConfigError, did_you_mean


def import_modules(names: Sequence[str], where: str = "--import") -> None:
    """Import each of `names`, a dotted module name or a path to a .py file, for its registrations.
    A module that cannot be found is a ConfigError; errors raised by the module itself propagate."""
    for name in names:
        try:
            if name.endswith(".py"):
                _import_file(Path(name))
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


def _import_file(path: Path) -> None:
    if not path.is_file():
        raise FileNotFoundError(f"no file {str(path)!r}")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # registered names point at the module's functions, as for a normal import
    spec.loader.exec_module(module)


def load_object(spec: str, where: str) -> Any:
    """`module:name` or `path/file.py:name` -> the object; `where` names the flag or key in errors."""
    module, _, name = spec.rpartition(":")
    if not module or not name.isidentifier():
        raise ConfigError(f"{where} {spec!r} is not 'module:name' or 'file.py:name'",
                          fix="e.g. my_module:my_function or path/to/file.py:my_function")
    import_modules([module], f"{where} {spec!r}: cannot import")
    key = Path(module).stem if module.endswith(".py") else module
    found = getattr(sys.modules.get(key), name, None)
    if found is None:
        raise ConfigError(f"{where} {spec!r}: {module} has no {name!r}", fix="name a function the module defines")
    return found


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
