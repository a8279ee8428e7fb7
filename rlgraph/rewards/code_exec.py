"""Code-execution reward: run each completion's code against the row's tests in a sandboxed subprocess.

    CodeTests(timeout_s=5, memory_mb=512)(completions, tests=[...])  -> fraction of tests passed

The code is the last fenced block of the completion (```python ... ``` or ``` ... ```), else the
whole completion. A row's `tests` (the field is `tests_field`, passed through `data.extra_fields`)
is one of:
  - a string of Python (asserts): one test, passed when it runs without raising;
  - a list of such strings: each counted on its own;
  - a list of {"input": str, "output": str}: the code runs as a script with that stdin, and passes
    when its stdout equals `output` (both stripped).

Each completion runs in its own process: a fresh temporary working directory (removed afterwards),
an environment with nothing of the parent's, `python -I -S` (the standard library only: no
site-packages, no PYTHON* variables), resource limits (address space `memory_mb`, CPU seconds, 16 MiB files, 64
open files, no core dumps), its own process group killed after `timeout_s` of wall time, and no
network: a new network namespace with no interfaces (`unshare -rn`) where the kernel allows
unprivileged namespaces, and in any case Python's sockets replaced by a stub that raises.

This keeps a model's honest mistakes (infinite loops, memory blow-ups, stray files) from harming
the run. It is not a security boundary against adversarial code: use a container sandbox for that.
"""

from __future__ import annotations

import json
import os
import re
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Any

from rlgraph.ir.errors import ConfigError

_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)

# Runs inside the sandbox: `python -I harness.py`, with RLGRAPH_NONCE in its environment.
_HARNESS = r'''
import io, json, os, socket, sys

def _no_network(*args, **kwargs):
    raise OSError("network access is disabled in the rlgraph code sandbox")

class _NoSocket(socket.socket):
    def __init__(self, *args, **kwargs):
        _no_network()

socket.socket = _NoSocket
socket.create_connection = socket.socketpair = socket.getaddrinfo = _no_network
nonce = os.environ.pop("RLGRAPH_NONCE")
real_stdout = sys.stdout
source = open("solution.py", encoding="utf-8").read()
tests = json.load(open("tests.json", encoding="utf-8"))
passed, error = 0, None

def run(stdin_text):
    sys.stdin, sys.stdout, sys.stderr = io.StringIO(stdin_text), io.StringIO(), io.StringIO()
    try:
        namespace = {"__name__": "__main__", "__builtins__": __builtins__}
        exec(compile(source, "solution.py", "exec"), namespace)
        return namespace, sys.stdout.getvalue()
    finally:
        sys.stdin, sys.stdout, sys.stderr = sys.__stdin__, real_stdout, sys.__stderr__

try:
    if tests["kind"] == "io":
        for case in tests["cases"]:
            try:
                _, out = run(case["input"])
                passed += out.strip() == case["output"].strip()
            except BaseException as exc:
                error = error or f"{type(exc).__name__}: {exc}"
    else:
        namespace, _ = run("")
        for test in tests["cases"]:
            try:
                sys.stdout, sys.stderr = io.StringIO(), io.StringIO()
                exec(compile(test, "test", "exec"), dict(namespace))
                passed += 1
            except BaseException as exc:
                error = error or f"{type(exc).__name__}: {exc}"
            finally:
                sys.stdout, sys.stderr = real_stdout, sys.__stderr__
except BaseException as exc:
    error = f"{type(exc).__name__}: {exc}"
real_stdout.write(nonce + json.dumps({"passed": passed, "error": error}) + "\n")
real_stdout.flush()
'''


def extract_code(completion: str) -> str:
    """The last fenced code block of `completion` (a python one preferred), else the whole text."""
    blocks = _FENCE.findall(completion)
    if not blocks:
        return completion
    python = [body for language, body in blocks if language.lower() in ("python", "py", "python3")]
    return (python or [body for _, body in blocks])[-1]


def _cases(tests: Any, row: int, field: str) -> tuple[str, list[Any]]:
    """("asserts" or "io", cases) from a row's tests; a ValueError naming the row when malformed."""
    if isinstance(tests, str):
        return "asserts", [tests]
    if isinstance(tests, (list, tuple)) and tests:
        if all(isinstance(t, str) for t in tests):
            return "asserts", list(tests)
        if all(isinstance(t, dict) and {"input", "output"} <= set(t) for t in tests):
            return "io", [{"input": str(t["input"]), "output": str(t["output"])} for t in tests]
    raise ValueError(f"code: row {row}'s {field!r} is {type(tests).__name__} {str(tests)[:80]!r}; expected a string "
                     "of asserts, a non-empty list of them, or a list of {input, output} objects")


@lru_cache(maxsize=1)
def network_namespace_available() -> bool:
    """Whether `unshare -rn` (a user + network namespace) works here."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    try:
        return subprocess.run([unshare, "-rn", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


class CodeTests:
    """Score = fraction of a row's tests the completion's code passes (`partial=False`: 1.0 only if all)."""

    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 512, partial: bool = True, tests_field: str = "tests",
                 workers: int | None = None, python: str | None = None):
        for name, value, low in (("timeout_s", timeout_s, 0), ("memory_mb", memory_mb, 32)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > low:
                raise ConfigError(f"code: {name}={value!r} must be a number > {low}")
        if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
            raise ConfigError(f"code: workers={workers!r} must be a whole number >= 1")
        self.timeout_s, self.memory_mb, self.partial = float(timeout_s), int(memory_mb), bool(partial)
        self.tests_field, self.workers, self.python = tests_field, workers or (os.cpu_count() or 1), python or sys.executable

    @property
    def fields(self) -> tuple[str, ...]:
        """The per-row fields this reward reads (checked against the data before a run starts)."""
        return (self.tests_field,)

    def __call__(self, completions: Sequence[str], **meta: Any) -> list[float]:
        if self.tests_field not in meta:
            raise ValueError(f"code: the rollouts carry no {self.tests_field!r} field (they carry "
                             f"{', '.join(sorted(meta)) or 'none'}); list it in data.extra_fields")
        tests = meta[self.tests_field]
        jobs = [(extract_code(text), *_cases(case, row, self.tests_field)) for row, (text, case)
                in enumerate(zip(completions, tests, strict=True))]
        with ThreadPoolExecutor(self.workers) as pool:
            results = list(pool.map(lambda job: self.run(*job)["passed"] / len(job[2]), jobs))
        return results if self.partial else [float(score == 1.0) for score in results]

    def run(self, code: str, kind: str, cases: list[Any]) -> dict[str, Any]:
        """{"passed": int, "error": str | None, "timed_out": bool} of one program against its cases."""
        nonce = secrets.token_hex(16)
        with tempfile.TemporaryDirectory(prefix="rlgraph-code-") as workdir:
            for name, text in (("solution.py", code), ("harness.py", _HARNESS),
                               ("tests.json", json.dumps({"kind": kind, "cases": cases}))):
                with open(os.path.join(workdir, name), "w", encoding="utf-8") as handle:
                    handle.write(text)
            command = [self.python, "-I", "-S", "harness.py"]  # isolated, no site-packages: the standard library only
            if network_namespace_available():
                command = [shutil.which("unshare"), "-rn", *command]
            env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8", "RLGRAPH_NONCE": nonce,
                   "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
            process = subprocess.Popen(command, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                       stderr=subprocess.DEVNULL, start_new_session=True, preexec_fn=self._limits)
            try:
                out, _ = process.communicate(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                _kill(process)
                return {"passed": 0, "error": f"timed out after {self.timeout_s:g} s", "timed_out": True}
            finally:
                _kill(process)  # anything it left behind in its process group
        for line in reversed(out.decode("utf-8", "replace").splitlines()):
            if line.startswith(nonce):
                result = json.loads(line[len(nonce):])
                return {"passed": min(int(result["passed"]), len(cases)), "error": result["error"], "timed_out": False}
        return {"passed": 0, "error": f"the program ended without a result (exit code {process.returncode})",
                "timed_out": False}

    def _limits(self) -> None:
        """Runs in the child before exec: its resource limits."""
        memory = self.memory_mb * 2**20
        cpu = int(self.timeout_s) + 1
        for limit, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_FSIZE, 16 * 2**20),
                             (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(limit, (value, value))

    def __repr__(self) -> str:
        return f"CodeTests(timeout_s={self.timeout_s:g}, memory_mb={self.memory_mb}, partial={self.partial})"


def _kill(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()
