"""Run one untrusted Python program in a bubblewrap sandbox and read what it prints, with hard bounds.

    run_sandboxed(script, stdin=b"...", limits=SandboxLimits(...)) -> SandboxOutcome

The program (`python -I -S -c script`) runs under `bwrap` with new user, PID, network, IPC, UTS and
cgroup namespaces, a new session (no controlling terminal), a fresh /proc of its own PID namespace,
a read-only root holding only /usr (and the interpreter's own files), a size-capped tmpfs at /tmp as
the only writable place, an empty environment, no capabilities and no further user namespaces.
The parent (this process) enforces the rest from outside, where the program cannot reach:
  - wall time: SIGKILL at the deadline, which fires even if the program stopped itself (SIGSTOP);
  - output: stdout is read with a byte cap and the sandbox is killed when it is exceeded;
  - cleanup: killing bwrap kills the namespace's init (`--die-with-parent`), and the kernel then
    kills every process left in the PID namespace, setsid'd or double-forked ones included.
Resource limits (address space, CPU seconds, file size, open files, no core, process count) are set
by the harness on itself before it reads the code; RLIMIT_NPROC is counted per user namespace there,
so it does not count the trainer's own threads. The kernel does not enforce RLIMIT_NPROC for host
root, so a trainer running as root starts bwrap as uid 65534 (nobody).
See docs/security.md for the threat model.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import attrs

from rlgraph.errors import ConfigError

NOBODY = 65534
# Where Debian-like systems keep a Python that any user may run; used when the trainer runs as root
# and its own interpreter lives somewhere only root can reach (e.g. under /root/.pyenv).
SYSTEM_PYTHON = "/usr/bin/python3"
OPT_OUT = "opt out of isolation explicitly with isolation='none' (only for code you trust: see docs/security.md)"
INSTALL_HINT = ("install bubblewrap (Debian/Ubuntu: `apt-get install bubblewrap`; Fedora: `dnf install bubblewrap`), "
                "or " + OPT_OUT)


@attrs.frozen
class SandboxLimits:
    """Per-program bounds. `memory_mb` is per process; at most `max_processes` of them exist at once."""

    timeout_s: float = 5.0
    memory_mb: int = 512
    max_processes: int = 8
    output_bytes: int = 1 << 20
    tmp_bytes: int = 16 << 20


@attrs.frozen
class SandboxOutcome:
    stdout: bytes
    returncode: int | None
    timed_out: bool
    output_exceeded: bool
    seconds: float


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


def require_bwrap() -> str:
    """The bwrap executable, or a ConfigError saying how to get it."""
    path = bwrap_path()
    if path is None:
        raise ConfigError("code: isolation='bwrap' needs the `bwrap` executable (bubblewrap), which is not on PATH",
                          fix=INSTALL_HINT)
    return path


@functools.lru_cache(maxsize=8)
def bwrap_failure(python: str) -> str | None:
    """Why a trivial program cannot run in the sandbox here (None: it can). Cached per interpreter."""
    bwrap = bwrap_path()
    if bwrap is None:
        return "the `bwrap` executable (bubblewrap) is not on PATH"
    limits = SandboxLimits(timeout_s=10)
    try:
        command = bwrap_command(bwrap, sandbox_python(python), "print('ok')", limits)
    except ConfigError as exc:
        return exc.summary
    try:
        done = subprocess.run(command, capture_output=True, timeout=limits.timeout_s, cwd="/", **_as_nobody())
    except (OSError, subprocess.SubprocessError) as exc:
        return f"bwrap could not be started: {exc}"
    if done.stdout.strip() != b"ok":
        return f"bwrap failed (exit code {done.returncode}): {done.stderr.decode(errors='replace').strip()[:300]}"
    return None


def require_sandbox(python: str) -> None:
    """A ConfigError unless bwrap is installed and works here (user namespaces allowed, interpreter reachable)."""
    require_bwrap()
    failure = bwrap_failure(python)
    if failure is not None:
        raise ConfigError(f"code: isolation='bwrap' cannot run a program here: {failure}",
                          fix="allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1 or "
                              "user.max_user_namespaces > 0; in a container, run it with a seccomp profile that "
                              "permits them), or " + OPT_OUT)


def _reachable_by_others(path: str) -> bool:
    """Whether every directory above `path` lets other users through (so uid 65534 can run it)."""
    path = os.path.realpath(path)
    parent = os.path.dirname(path)
    while True:
        if not os.stat(parent).st_mode & stat.S_IXOTH:
            return False
        if parent == "/":
            return True
        parent = os.path.dirname(parent)


def sandbox_python(python: str) -> str:
    """The interpreter the sandbox runs: `python`, unless we run as root and uid 65534 cannot reach it."""
    if os.geteuid() != 0 or _reachable_by_others(python):
        return python
    if os.path.exists(SYSTEM_PYTHON) and _reachable_by_others(SYSTEM_PYTHON):
        return SYSTEM_PYTHON
    raise ConfigError(f"code: the trainer runs as root, so the sandbox runs as uid {NOBODY}, which cannot reach the "
                      f"interpreter {python!r} (a directory above it is closed to other users)",
                      fix=f"pass python='/path/to/python3' readable by all users, or install {SYSTEM_PYTHON}")


def interpreter_files(python: str) -> list[str]:
    """What an interpreter outside /usr needs: its executable, lib/python3.* and lib/libpython3*.so*.

    Not its whole prefix: a python in /home/me/bin would otherwise expose /home/me.
    """
    executable = os.path.realpath(python)
    if executable.startswith("/usr/"):
        return []
    lib = os.path.join(os.path.dirname(os.path.dirname(executable)), "lib")
    return [executable, *sorted(glob.glob(os.path.join(lib, "python3*"))),
            *sorted(glob.glob(os.path.join(lib, "libpython3*.so*")))]


def bwrap_command(bwrap: str, python: str, script: str, limits: SandboxLimits) -> list[str]:
    """The bwrap argv running `python -I -S -c script`: read-only /usr and interpreter, tmpfs /tmp."""
    binds = ["--ro-bind", "/usr", "/usr"]
    for top in ("lib", "lib64", "bin"):  # merged-/usr systems link these; older ones have real directories
        host = "/" + top
        if os.path.islink(host):
            binds += ["--symlink", os.readlink(host), host]
        elif os.path.isdir(host):
            binds += ["--ro-bind", host, host]
    for path in interpreter_files(python):
        binds += ["--ro-bind", path, path]
    # /dev holds only the character devices a program needs; the root is remounted read-only last,
    # so /tmp (size-capped) is the only place it can write.
    devices = [arg for dev in ("null", "zero", "urandom", "random")
               for arg in ("--dev-bind", f"/dev/{dev}", f"/dev/{dev}")]
    return [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
            "--clearenv", "--cap-drop", "ALL", "--hostname", "sandbox", *binds, "--proc", "/proc", *devices,
            "--size", str(limits.tmp_bytes), "--tmpfs", "/tmp", "--remount-ro", "/", "--chdir", "/tmp",
            "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp", "--setenv", "LANG", "C.UTF-8",
            "--setenv", "PYTHONHASHSEED", "0", "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
            "--setenv", "RLGRAPH_LIMITS", limits_env(limits, count_processes=True),
            os.path.realpath(python), "-I", "-S", "-c", script]  # a venv's bin/python links out of the view


def limits_env(limits: SandboxLimits, count_processes: bool) -> str:
    """The resource limits the harness sets on itself before it reads the code (RLIMIT name -> value).

    Set there rather than in a preexec_fn, which is unsafe in a threaded trainer (the reward's
    thread pool). RLIMIT_NPROC only inside a user namespace: outside it counts the trainer's threads.
    """
    values = {"RLIMIT_AS": limits.memory_mb * 2**20, "RLIMIT_CPU": int(limits.timeout_s) + 1,
              "RLIMIT_FSIZE": limits.tmp_bytes, "RLIMIT_NOFILE": 64, "RLIMIT_CORE": 0}
    if count_processes:
        values["RLIMIT_NPROC"] = limits.max_processes
    return json.dumps(values)


def _as_nobody() -> dict[str, Any]:
    """Popen options that make the child uid/gid 65534 when we are root (done in C, after fork)."""
    return {"user": NOBODY, "group": NOBODY, "extra_groups": []} if os.geteuid() == 0 else {}


def run_sandboxed(script: str, stdin: bytes, limits: SandboxLimits, python: str | None = None,
                  isolation: str = "bwrap") -> SandboxOutcome:
    """Run `script` with `stdin`; return its stdout (at most `limits.output_bytes`) and how it ended."""
    python = python or sys.executable
    if isolation == "bwrap":
        return _run(bwrap_command(require_bwrap(), sandbox_python(python), script, limits), stdin, limits,
                    _as_nobody(), "/", {})
    # isolation="none": resource limits, a private working directory and a process group; no boundary.
    # No process-count limit either: outside a user namespace RLIMIT_NPROC would count the trainer's threads.
    with tempfile.TemporaryDirectory(prefix="rlgraph-code-") as workdir:
        env = {"HOME": workdir, "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1",
               "RLGRAPH_LIMITS": limits_env(limits, count_processes=False)}
        return _run([python, "-I", "-S", "-c", script], stdin, limits, {}, workdir, env)


def _run(command: list[str], stdin: bytes, limits: SandboxLimits, identity: dict[str, Any], cwd: str,
         env: dict[str, str]) -> SandboxOutcome:
    start = time.monotonic()
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                               env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", **env}, cwd=cwd,
                               start_new_session=True, **identity)
    writer = threading.Thread(target=_feed, args=(process.stdin, stdin), daemon=True)
    writer.start()
    try:
        stdout, timed_out, exceeded = _read_capped(process, start + limits.timeout_s, limits.output_bytes)
    finally:
        _kill(process)
        writer.join(timeout=1)
    return SandboxOutcome(stdout, process.returncode, timed_out, exceeded, time.monotonic() - start)


def _feed(pipe, data: bytes) -> None:
    try:
        pipe.write(data)
        pipe.close()
    except (BrokenPipeError, OSError, ValueError):
        pass  # the program exited or closed its stdin: what it did not read does not matter


def _read_capped(process: subprocess.Popen, deadline: float, cap: int) -> tuple[bytes, bool, bool]:
    """(stdout, timed_out, output_exceeded): read until EOF, the deadline or `cap` bytes, whichever first."""
    chunks, size = [], 0
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return b"".join(chunks), True, False
            if not selector.select(timeout=left):
                continue
            chunk = os.read(process.stdout.fileno(), 1 << 16)
            if not chunk:
                return b"".join(chunks), False, False
            chunks.append(chunk[:cap - size])
            size += len(chunk)
            if size > cap:
                return b"".join(chunks), False, True


def _kill(process: subprocess.Popen) -> None:
    """SIGKILL the whole process group (bwrap; with it the PID namespace) and reap it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.stdout.close()
    process.wait()
