"""The user's files given by path (`env.path: hl_env.py:MyEnv`, `algorithm.name: algos.py:my_grpo`,
`--import rewards.py`), loaded in every process that runs them.

A file loaded by path becomes the module named by its stem (`hl_env`), as `python hl_env.py`
would name it for its imports, and its directory joins `sys.path` (for its own sibling imports).
Objects it defines pickle by reference (`hl_env.MyEnv`), so a process that unpickles them (a spmd
rank, a Ray actor, an environment or reward worker) must hold the same module: the transports send
`loaded_files()` with their recipe and `load_files` imports each file there from its path before
anything is unpickled. A file that cannot load there is a `UserFileError` naming the file, the
process (its rank) and the fix, instead of a raw unpickling traceback.

    module = import_file(Path("examples/hl_env.py"))   # in the controller
    files = loaded_files()                              # {"hl_env": "/abs/examples/hl_env.py"}
    load_files(files, "rank 1")                         # in another process, before unpickling
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

from rlgraph.errors import RLGraphError

_LOADED: dict[str, str] = {}  # module name -> the absolute path of the file it was loaded from


class UserFileError(RLGraphError):
    """A user's file that loaded in the controller cannot load in another process."""


def import_file(path: Path) -> ModuleType:
    """Load `path` as the module named by its stem (registered in `sys.modules`, as a normal import
    would), with its directory on `sys.path`; remembered for `loaded_files`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no file {str(path)!r}")
    path = path.resolve()
    directory = str(path.parent)
    if directory not in sys.path:
        sys.path.append(directory)  # after the installed packages: a user's `random.py` must not shadow them
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # registered names point at the module's functions, as for a normal import
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(path.stem, None)  # a half-run module must not satisfy a later import
        raise
    _LOADED[path.stem] = str(path)
    return module


def loaded_files() -> dict[str, str]:
    """The files this process loaded by path: module name -> absolute path (plain data, to send)."""
    return dict(_LOADED)


def load_files(files: Mapping[str, str], where: str) -> None:
    """In another process (`where`: "rank 1", "an environment worker"), load each of the controller's
    files from its path, unless a module of that name from that file is already here."""
    for name, path in files.items():
        held = sys.modules.get(name)
        if held is not None and getattr(held, "__file__", None) == path:
            continue
        try:
            import_file(Path(path))
        except Exception as error:  # noqa: BLE001 - any failure of the user's file, named with the process
            raise UserFileError(
                f"{where} cannot load {path} (module {name!r}, which the controller loaded from that path): "
                f"{type(error).__name__}: {error}\n  fix: the file must exist at the same path and import in every "
                "process of the run (on several nodes: a shared filesystem, or the same checkout at the same "
                "path); its own imports must be installed there too") from None


def unpickle(blob: bytes, files: Mapping[str, str], where: str) -> object:
    """`pickle.loads(blob)` in another process, after `load_files(files)`: a module the pickle names
    that cannot be imported here is a `UserFileError` naming `where`, not a raw unpickling traceback."""
    import pickle

    load_files(files, where)
    try:
        return pickle.loads(blob)
    except (ImportError, AttributeError) as error:
        missing = getattr(error, "name", None)
        raise UserFileError(
            f"{where} cannot rebuild what the controller sent it: {type(error).__name__}: {error}"
            f"{'' if missing is None else f' (module {missing!r} imports in the controller, not here)'}\n"
            "  fix: give your code by file path (env.path: my_env.py:MyEnv, algorithm.name: my_algos.py:fn), "
            "which every process loads from that path, or install its module where the run's processes run") from None
