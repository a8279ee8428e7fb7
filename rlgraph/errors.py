"""The project's own error types. User mistakes raise these; internal invariants use `assert`."""

from __future__ import annotations

import difflib
import linecache
import os
import sys
from collections.abc import Iterable
from types import FrameType

import attrs

# rlgraph's own package directory, not the folder above it: in an editable install that folder is the
# checkout, which also holds the user's files (examples/, a script beside the Makefile) and the venv
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_SKIP_DIRS = (_PACKAGE_DIR + os.sep, os.path.dirname(os.path.abspath(__import__("torch").__file__)) + os.sep)
_BUILTIN_ALGORITHMS = os.path.join(_PACKAGE_DIR, "algorithms") + os.sep  # written as a user would: their lines are named


class RLGraphError(Exception):
    """Base class of every error rlgraph raises on purpose."""


@attrs.frozen
class SourceLocation:
    file: str
    line: int
    function: str

    @property
    def code(self) -> str:
        return linecache.getline(self.file, self.line).strip()

    def __str__(self) -> str:
        return f"{os.path.relpath(self.file) if not self.file.startswith('<') else self.file}:{self.line}"


def user_location(frame: FrameType | None = None) -> SourceLocation | None:
    """The innermost stack frame outside rlgraph and torch: the user's line that is being traced."""
    frame = frame or sys._getframe(1)
    while frame is not None:
        raw = frame.f_code.co_filename
        filename = raw if raw.startswith("<") else os.path.abspath(raw)  # "<...>": generated code, kept for linecache
        if raw.startswith("<frozen "):  # the interpreter's own start-up (runpy, importlib): never the user's
            frame = frame.f_back
            continue
        if not filename.startswith(_SKIP_DIRS) or filename.startswith(_BUILTIN_ALGORITHMS):
            return SourceLocation(filename, frame.f_lineno, frame.f_code.co_name)
        frame = frame.f_back
    return None


class TraceError(RLGraphError):
    """A mistake found while tracing an algorithm; names the user's file and line."""

    def __init__(self, message: str, where: SourceLocation | None = None, fix: str | None = None):
        self.where, self.fix = where, fix
        self.summary = message
        parts = [message]
        if where is not None:
            parts.append(f"  at {where} in {where.function}():  {where.code}")
        if fix:
            parts.append(f"  fix: {fix}")
        super().__init__("\n".join(parts))


class SpecError(TraceError):
    """A shape or dtype mismatch between traced values."""


class VerifyError(RLGraphError):
    """A program or plan broke an invariant; names the pass that produced it when known."""


class ConfigError(RLGraphError, ValueError):
    """A user-given option has a bad value: an argument of `rg.compile`, a CLI flag, a config key.

    The message names the value and where it came from; `fix` says what to write instead. It is a
    ValueError too, so callers that caught the raw ValueError before keep working.
    """

    def __init__(self, message: str, fix: str | None = None):
        self.summary, self.fix = message, fix
        super().__init__(message + (f"\n  fix: {fix}" if fix else ""))


class RankFailure(RLGraphError):
    """Something on one rank failed (a worker, its generation engine); `rank` says which (None: several).

    The plan runner turns it into a `PlanStepError` naming the plan step, its stage and its role, on
    every runtime: a worker's failure arrives as one, and an engine in the controller's process (the
    local runtime's vLLM) raises one."""

    def __init__(self, message: str, rank: int | None = None, cause: str = "", step: object = None):
        super().__init__(message)
        self.rank = rank
        self.cause = cause
        self.step = step  # the plan step whose command failed, when it was sent before the current one


class RewardError(RLGraphError, ValueError):
    """A reward that raised, timed out, or returned something other than one finite number per rollout."""


def did_you_mean(name: object, choices: Iterable[str]) -> str:
    """"; did you mean 'x'?" when `name` is close to one of `choices`, else ""."""
    close = difflib.get_close_matches(str(name), list(choices), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""
