"""Supervised worker processes: what a reward or an environment does never reaches the controller.

    pool = SupervisedPool(factory, workers=2, names=PoolNames("reward_", "reward", "reward_timeout_s", "scores"))
    answers = pool.run([payload, ...], timeout_s=600)              # any free worker takes a call
    answers = pool.run([payload, ...], timeout_s=30, slots=[0, 1])  # call i on the worker of slot i
    pool.close()                                                    # every worker and its descendants killed

Each worker (`process.py`) builds a handler from the picklable `factory` once (the reward terms,
a rollout's environments), then answers one pickled request at a time with JSON. A pool has
`workers` slots; a call may name the slot whose worker must answer it (an environment lives in
one worker), or take any free one. Calls named to a slot are written to its worker at once and
answered in order (no round trip between them); the others go one at a time to idle workers. The
controller enforces the rest from outside, where a handler cannot reach:
  - a call that runs past `timeout_s` (counted from when its worker starts it: hung, in a C loop,
    stopped by SIGSTOP) gets its worker killed
    (SIGKILL to the worker's process group) and replaced; a worker that dies is replaced too; either
    way the call's answer is a failure {"failed": "timed out after 600 s (...)", "killed by signal 9
    ...", "exited with code 3 ..."}, which the client turns into its own (a reward's `on_error`
    policy, an environment's ended episode); calls queued behind it never ran and go to its
    replacement;
  - answers are JSON, read with a byte cap (`answer_bytes`), never unpickled, and checked by the
    client's `valid`; requests are written without blocking, so a stopped worker cannot stall the
    controller on a full socket;
  - memory: RLIMIT_AS = `memory_mb` per process of the worker (its children inherit it).
Isolation (`isolation`, "auto" picks the first that works here):
  - "pidns": each worker runs under bubblewrap in its own PID (and user) namespace and session, with
    the host's filesystem and network: the controller has no PID there, so `os.kill(os.getppid())`,
    `killpg` and `kill(-1)` reach only the worker's own namespace, which dies whole when it is killed
    (forked, setsid'd children too); RLIMIT_NPROC (`max_processes`) applies inside its user namespace.
  - "process": a sacrificial keeper process is the worker's parent and its own session; the worker dies
    with it (PR_SET_PDEATHSIG). `os.kill(os.getppid())` and `killpg(0)` stay contained, but a handler
    that looks the controller's PID up (/proc) can still signal it, a setsid'd child can outlive the
    worker, and there is no process-count limit. See docs/security.md.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import os
import pickle
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from rlgraph.errors import ConfigError
from rlgraph.supervised.process import HEADER

ISOLATIONS = ("auto", "pidns", "process")
MIN_PROGRESS_S = 0.05  # CPU seconds a starting worker must use in a period to count as starting, not hung
_TICKS = os.sysconf("SC_CLK_TCK")
_ROOT = str(Path(__file__).resolve().parents[2])  # the directory holding the rlgraph package
# process.py is loaded as a file: it imports only the standard library until it serves, so the
# keeper (which forks before that) stays small; the worker imports rlgraph (and torch) after its limits.
_LAUNCH = (f"import sys, importlib.util as u; sys.path.insert(0, {_ROOT!r}); "
           f"s = u.spec_from_file_location('rlgraph_worker_process', {str(Path(__file__).with_name('process.py'))!r}); "
           "m = u.module_from_spec(s); s.loader.exec_module(m); m.main()")


@attrs.frozen
class PoolNames:
    """How a client's settings are called in its messages: `prefix` + workers / memory_mb /
    max_processes / isolation (`reward_workers`, `env.workers`), `what` the worker is for
    ("reward", "environment"), `timeout` the setting a late call exceeded, `answer` what its
    handler answers ("scores")."""

    prefix: str
    what: str
    timeout: str
    answer: str

    def __call__(self, setting: str) -> str:
        return self.prefix + setting


@functools.lru_cache(maxsize=1)
def pid_namespace_failure() -> str | None:
    """Why a worker cannot get its own PID namespace here (None: it can). Probed once per process,
    the way a worker starts (bubblewrap, then its own /proc)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return "the `bwrap` executable (bubblewrap) is not on PATH"
    try:
        done = subprocess.run([*_bwrap_prefix(bwrap), sys.executable, "-c", _LAUNCH, "--mount-proc", "--probe"],
                              capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"bwrap could not be started: {exc}"
    if done.stdout.strip() != b"2":  # the first process after bwrap's init in a fresh namespace
        return f"bwrap failed (exit code {done.returncode}): {done.stderr.decode(errors='replace').strip()[-300:]}"
    return None


def _bwrap_prefix(bwrap: str) -> list[str]:
    """A new PID namespace and session over the host's own filesystem, devices and network. A new
    user namespace unless we are root, with CAP_SYS_ADMIN there only (to mount the worker's own
    /proc: process._mount_proc); root keeps its capabilities, since the `code` reward's
    sandbox starts as uid 65534, which a user namespace mapping only uid 0 could not become."""
    user = [] if os.geteuid() == 0 else ["--unshare-user", "--cap-add", "CAP_SYS_ADMIN"]
    return [bwrap, *user, "--unshare-pid", "--die-with-parent", "--new-session", "--bind", "/", "/",
            "--dev-bind", "/dev", "/dev", "--chdir", os.getcwd()]


def resolve_isolation(isolation: str, setting: str = "reward_isolation") -> str:
    """`isolation` ("auto", "pidns", "process") resolved for this host; `setting` names it in errors."""
    if isolation not in ISOLATIONS:
        raise ConfigError(f"{setting}={isolation!r} is not one of {', '.join(ISOLATIONS)}")
    failure = pid_namespace_failure() if isolation in ("auto", "pidns") else None
    if isolation == "pidns" and failure is not None:
        raise ConfigError(f"{setting}=pidns: a worker process cannot get its own PID namespace here: {failure}",
                          fix="install bubblewrap and allow unprivileged user namespaces, or set "
                              f"{setting}: process (weaker: docs/security.md)")
    return "pidns" if isolation == "pidns" or (isolation == "auto" and failure is None) else "process"


class _Worker:
    """One worker process and the controller's end of its channel (non-blocking, framed). It answers
    the calls sent to it in order; `calls` holds those not answered yet (the first is the one it runs)."""

    def __init__(self, process: subprocess.Popen, channel: socket.socket, slot: int):
        self.process, self.channel, self.slot = process, channel, slot
        self.outgoing, self.incoming = b"", b""
        self.calls: deque[int] = deque()
        self.deadline, self.limit = 0.0, float("inf")
        self.starting = False  # its build call is not answered yet
        self.cpu_mark = 0.0    # its CPU seconds when its start deadline was last set

    @property
    def call(self) -> int | None:
        """The call it is answering now (None: idle)."""
        return self.calls[0] if self.calls else None

    def send(self, payload: bytes, call: int, limit: float) -> None:
        """Queue `call` behind the ones sent before: it has `limit` seconds from when it becomes the
        one the worker runs (the previous one answered), not from now."""
        if not self.calls:
            self.deadline = time.monotonic() + limit
        self.outgoing += HEADER.pack(len(payload)) + payload
        self.calls.append(call)
        self.limit = limit

    def answered(self) -> int:
        """The call just answered; the next one's time starts."""
        call = self.calls.popleft()
        self.deadline = time.monotonic() + self.limit
        self.starting = False
        return call

    def still_starting(self, limit: float) -> bool:
        """Past its start deadline: whether to wait one more period of `limit` seconds. A start costs
        CPU (the worker imports torch and rlgraph: ~7 CPU seconds), and on a loaded machine it waits
        for a core far longer than that (measured: 27-35 s of wall time for it at load average 16 on
        2 cores, over 120 s at 15-18 with the controller busy), so wall time alone cannot tell a slow
        start from a hung one: a worker that used CPU since the last deadline, and less than `limit`
        CPU seconds in all, is starting; one that used none for a whole period (blocked, stopped) or
        more than `limit` (a runaway) is late."""
        used = _cpu_seconds(self.process.pid)
        if not self.starting or used - self.cpu_mark < MIN_PROGRESS_S or used > limit:
            return False
        self.cpu_mark, self.deadline = used, time.monotonic() + limit
        return True

    def pump(self, readable: bool, writable: bool, cap: int) -> list[bytes]:
        """Move bytes; the answers completed, in order. EOFError: the worker closed its end (it died);
        OverflowError: an answer longer than `cap` bytes."""
        if writable and self.outgoing:
            try:
                sent = self.channel.send(self.outgoing)
            except BlockingIOError:
                sent = 0
            except OSError:
                raise EOFError from None
            self.outgoing = self.outgoing[sent:]
        answers = []
        if readable:
            try:
                chunk = self.channel.recv(1 << 20)
            except BlockingIOError:
                chunk = None
            except OSError:
                raise EOFError from None
            if chunk == b"":
                raise EOFError
            self.incoming += chunk or b""
            while len(self.incoming) >= HEADER.size:
                size = HEADER.unpack(self.incoming[:HEADER.size])[0]
                if size > cap:
                    raise OverflowError(size)
                if len(self.incoming) < HEADER.size + size:
                    break
                answers.append(self.incoming[HEADER.size:HEADER.size + size])
                self.incoming = self.incoming[HEADER.size + size:]
        return answers

    def kill(self, grace_s: float = 0.0) -> str:
        """SIGKILL its process group (with it the PID namespace or the keeper's group) after `grace_s`
        for it to end on its own (it closed its channel: it is exiting); how it ended."""
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.channel.close()
        return _ended(self.process.wait())


def _cpu_seconds(pid: int) -> float:
    """CPU seconds used by process `pid` and every descendant it has now (bwrap or the keeper, then
    the worker), from /proc; 0 where /proc cannot tell (no `children` files: no progress is seen,
    and a start is bounded by wall time as before)."""
    total, stack = 0.0, [pid]
    while stack:
        current = stack.pop()
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / _TICKS  # utime and stime (fields 14 and 15)
            for task in os.listdir(f"/proc/{current}/task"):
                stack += [int(child) for child in Path(f"/proc/{current}/task/{task}/children").read_text().split()]
        except (OSError, ValueError, IndexError):  # gone meanwhile, or no such files here
            continue
    return total


def _ended(code: int) -> str:
    """How a worker ended, from its exit status (bwrap and the keeper exit with 128 + the signal)."""
    if code < 0 or code > 128:
        number = -code if code < 0 else code - 128
        try:
            return f"killed by signal {number} ({signal.Signals(number).name})"
        except ValueError:
            return f"killed by signal {number}"
    return f"exited with code {code}"


class SupervisedPool:
    """A small pool of supervised worker processes, started on first use (module docstring)."""

    def __init__(self, factory: Callable[[], Any], workers: int, *, names: PoolNames, memory_mb: int = 4096,
                 max_processes: int = 512, isolation: str = "auto", answer_bytes: int = 64 << 20,
                 start_timeout_s: float = 120.0, fix: str = ""):
        check_settings(names, workers, memory_mb, max_processes)
        try:
            self._factory = pickle.dumps(factory)
        except Exception as exc:  # a lambda or closure: the worker could not rebuild it
            raise ConfigError(f"what the {names.what} workers run cannot be sent to their processes: "
                              f"{type(exc).__name__}: {exc}", fix=fix or "define it at module level (importable by "
                              "its module path)") from None
        self.names, self.size, self.memory_mb, self.max_processes = names, workers, memory_mb, max_processes
        self.isolation = resolve_isolation(isolation, names("isolation"))
        self.answer_bytes, self.start_timeout_s = answer_bytes, start_timeout_s
        self._workers: list[_Worker] = []
        self._starting: list[_Worker] = []  # started by `start()`, not yet known to be ready
        self._lock = threading.Lock()
        # Popen from one long-lived thread: PR_SET_PDEATHSIG (bwrap's --die-with-parent, the keeper)
        # fires when the *thread* that started a process exits, not only the process.
        self._spawner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="supervised-pool")
        self._finalizer = weakref.finalize(self, _kill_all, self._workers)

    def describe(self) -> str:
        where = "own PID namespaces" if self.isolation == "pidns" else "keeper processes, no PID namespace"
        return f"{self.size} process{'es' if self.size > 1 else ''} ({where}), {self.memory_mb} MiB address space each"

    def pids(self) -> list[int]:
        """The host PIDs of the workers' top processes (bwrap or the keeper), by slot."""
        return [worker.process.pid for worker in sorted(self._workers, key=lambda worker: worker.slot)]

    def close(self) -> None:
        """Kill every worker and whatever its handler started; reap them. The pool may be used again."""
        with self._lock:
            _kill_all(self._workers)
            self._starting = []

    def __enter__(self) -> SupervisedPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- calls ----------------------------------------------------------------------------------
    def run(self, payloads: Sequence[bytes], timeout_s: float | None, *, slots: Sequence[int | None] | None = None,
            valid: Callable[[Any, int], bool] = lambda answer, call: isinstance(answer, dict)) -> list[dict[str, Any]]:
        """Each call's answer (JSON that `valid(answer, call)` accepts) or {"failed": what happened}.
        `slots[i]`: the slot whose worker must answer call i (None: any free worker)."""
        slots = list(slots) if slots is not None else [None] * len(payloads)
        assert len(slots) == len(payloads) and all(slot is None or 0 <= slot < self.size for slot in slots)
        with self._lock:
            self._start()
            return self._dispatch(list(payloads), timeout_s, slots, valid)

    def _dispatch(self, payloads: list[bytes], timeout_s: float | None, slots: list[int | None],
                  valid: Callable[[Any, int], bool]) -> list[dict[str, Any]]:
        """Calls taken by any worker go one at a time to idle workers; calls pinned to a slot are all
        sent to its worker at once (it answers them in order, without a round trip between them)."""
        answers: list[dict[str, Any] | None] = [None] * len(payloads)
        pending, limit = list(range(len(payloads))), timeout_s if timeout_s is not None else float("inf")
        late = f"timed out after {limit:g} s ({self.names.timeout})"
        with selectors.DefaultSelector() as selector:
            while pending or any(worker.call is not None for worker in self._workers):
                held = {worker.slot: worker for worker in self._workers}
                if pending and (not held or any(slots[call] is not None and slots[call] not in held for call in pending)):
                    self._start()  # a call's worker died earlier in this dispatch (or all did)
                    held = {worker.slot: worker for worker in self._workers}
                for call in list(pending):
                    worker = self._idle() if slots[call] is None else held.get(slots[call])
                    if worker is not None:
                        pending.remove(call)
                        worker.send(payloads[call], call, limit)
                busy = [worker for worker in self._workers if worker.call is not None]
                for call, answer in self._step(selector, busy, late, valid):
                    if answer is None:  # queued behind a call whose worker was killed: never ran, goes again
                        pending.insert(0, call)
                    else:
                        answers[call] = answer
        return answers

    def _idle(self) -> _Worker | None:
        return next((worker for worker in self._workers if worker.call is None), None)

    def _step(self, selector: selectors.BaseSelector, busy: list[_Worker], late: str,
              valid: Callable[[Any, int], bool]) -> list[tuple[int, dict | None]]:
        """Wait for the next event of the `busy` workers (bytes, a death, a deadline); the calls it
        finished (answer None: a call queued behind one whose worker was replaced, to send again).
        `late` is the problem a call past its deadline gets."""
        for worker in busy:
            selector.register(worker.channel, selectors.EVENT_READ | (selectors.EVENT_WRITE if worker.outgoing else 0),
                              worker)
        wait = min(worker.deadline for worker in busy) - time.monotonic()
        events = {key.data: mask for key, mask in selector.select(timeout=max(0.0, min(wait, 3600.0)))}
        for worker in busy:
            selector.unregister(worker.channel)
        done: list[tuple[int, dict | None]] = []
        for worker in busy:
            mask = events.get(worker, 0)
            try:
                raws = worker.pump(bool(mask & selectors.EVENT_READ), bool(mask & selectors.EVENT_WRITE),
                                   self.answer_bytes)
            except EOFError:
                done += self._replace(worker, None, grace_s=2.0)
                continue
            except OverflowError as size:
                done += self._replace(worker, f"answered {size} bytes, over the cap of {self.answer_bytes} bytes")
                continue
            for raw in raws:
                answer = _json(raw)
                if worker.call is None or not valid(answer, worker.call):  # the channel no longer holds our frames
                    done += self._replace(worker, f"answered something other than {self.names.answer} on its channel")
                    break
                done.append((worker.answered(), answer))
            else:
                if (worker.call is not None and time.monotonic() >= worker.deadline
                        and not worker.still_starting(self.start_timeout_s)):
                    done += self._replace(worker, late)
        return done

    def _replace(self, worker: _Worker, problem: str | None, grace_s: float = 0.0) -> list[tuple[int, dict | None]]:
        """Kill `worker` (a new one starts in its slot on the next call): the failure of the call it
        was running, and None for those queued behind it (they never ran)."""
        ended = worker.kill(grace_s)
        self._workers.remove(worker)
        what = self.names.what
        failure = {"failed": f"{problem} (its {what} worker was killed and replaced)" if problem
                   else f"{ended} in its {what} worker"}
        calls = list(worker.calls)
        return [(calls[0], failure), *((call, None) for call in calls[1:])] if calls else []

    # -- starting -------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the workers now, without waiting for them (the first call waits): their start (~1 s,
        importing torch) then overlaps what the controller does meanwhile."""
        with self._lock:
            self._starting += self._spawn_missing()

    def _spawn_missing(self) -> list[_Worker]:
        held = {worker.slot for worker in self._workers}
        fresh = [self._spawner.submit(self._spawn, slot).result() for slot in range(self.size) if slot not in held]
        self._workers.extend(fresh)
        build = pickle.dumps(("build", self._factory, list(sys.path)))
        for index, worker in enumerate(fresh):
            worker.send(build, index, self.start_timeout_s)
            worker.starting = True
        return fresh

    def _start(self) -> None:
        """Start workers in every empty slot (replacing idle ones that died between calls) and wait
        until each has built its handler. A build that fails raises `BuildError`."""
        for worker in [worker for worker in self._workers if worker.call is None and worker.process.poll() is not None]:
            worker.kill()
            self._workers.remove(worker)
        fresh, self._starting = self._starting + self._spawn_missing(), []
        for index, worker in enumerate(fresh):  # the build is each one's only call: number them in this list
            worker.calls = deque([index])
        answers: dict[int, dict[str, Any]] = {}
        late = (f"did not start: no CPU progress for {self.start_timeout_s:g} s, or over {self.start_timeout_s:g} CPU "
                "seconds")
        built = lambda answer, call: isinstance(answer, dict) and ("ready" in answer or "error" in answer)  # noqa: E731
        with selectors.DefaultSelector() as selector:
            while len(answers) < len(fresh):
                busy = [worker for worker in fresh if worker.call is not None]
                for call, answer in self._step(selector, busy, late, built):
                    answers[call] = answer
        broken = [answer for answer in answers.values() if "ready" not in answer]
        if broken:
            _kill_all(self._workers)
            raise BuildError(broken[0].get("error") or broken[0].get("failed"))

    def _spawn(self, slot: int) -> _Worker:
        ours, theirs = socket.socketpair()
        limits = {"RLIMIT_AS": self.memory_mb << 20, "RLIMIT_CORE": 0}
        if self.isolation == "pidns":
            if os.geteuid() != 0:  # RLIMIT_NPROC counts per user namespace; host root has none of its own
                limits["RLIMIT_NPROC"] = self.max_processes
            command = [*_bwrap_prefix(shutil.which("bwrap")), sys.executable, "-c", _LAUNCH, "--mount-proc"]
        else:
            command = [sys.executable, "-c", _LAUNCH, "--keeper"]
        command += ["--fd", str(theirs.fileno()), "--limits", json.dumps(limits)]
        try:
            process = subprocess.Popen(command, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                       start_new_session=True)
        finally:
            theirs.close()
        ours.setblocking(False)
        return _Worker(process, ours, slot)


class BuildError(Exception):
    """A worker could not build its handler (the message: what it raised, or how it died); the
    client re-raises it as its own error type, naming its recipe."""


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _kill_all(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.kill()
    workers.clear()


def check_settings(names: PoolNames, workers: Any, memory_mb: Any, max_processes: Any = 512, workers_hint: str = "1 or more"
                   ) -> None:
    """Refuse a worker count, memory limit or process limit that is not a whole number in range, by its name."""
    _check_count(names("workers"), workers, 1, workers_hint)
    _check_count(names("memory_mb"), memory_mb, 1024, "at least 1024 (a worker imports torch: ~700 MiB of address space)")
    _check_count(names("max_processes"), max_processes, 16, "at least 16 (threads count as processes)")


def _check_count(name: str, value: Any, least: int, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"{name}={value!r} must be a whole number, {hint}")
