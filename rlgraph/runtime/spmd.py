"""The `spmd` transport: one worker process per mesh rank on this machine, torch.distributed between them.

    transport = SpmdTransport(compiled.plan, world, device="cpu")     # starts plan.mesh.size processes
    runner = PlanRunner(compiled, transport, controller=world.controller())
    ...
    transport.close()                                                 # or `with SpmdTransport(...)`

The controller (this process) is not a rank: it talks to each worker over a pipe, sending the
commands of `rlgraph.runtime.transport` and the controller's pieces of values (pickled by value;
they are small next to the models). Workers talk to each other with torch.distributed (gloo on
CPU, NCCL on CUDA, rendezvous on a free local port): FSDP2's collectives, the plan's rank-to-rank
moves (`rlgraph.runtime.distributed.move_distributed`) and weight syncs.

Failures never hang the controller: every wait is on the workers' pipes and their process
sentinels together, with a timeout (default 60 s on CPU, 600 s on CUDA). A worker that raises
sends its error back; one that dies is seen by its sentinel; one that does not answer in time is
reported with the ranks still missing, and among them those whose process is stopped
(`rlgraph.runtime.worker_pool`). A command that a worker does not read within the timeout fails too (the
controller's end of each pipe has a send timeout). Workers ignore Ctrl-C (the controller stops
them), so an interrupt leaves one clean message.

Workers are forked from a server process (multiprocessing's `forkserver`) that imported torch and
transformers once: most of a rank's start on CPU was those imports (~5 s of ~7 s on a 2-core
machine), paid again by every pool a process starts. The server, and the resource tracker it
shares, live as long as the controller process and serve its every pool. Each worker takes the
controller's environment as it is when the pool starts (`os.environ`, as `spawn` would), and nothing
is preloaded that reads a run's settings when imported (rlgraph's own modules, whose Triton kernels
read TRITON_INTERPRET as they are defined, import in the worker).

Stopping is bounded: `close` tells idle workers to exit, then SIGTERM (with SIGCONT, so a stopped
worker acts on it) to the workers and their child processes after a grace of `GRACE_S`, then SIGKILL
after `TERM_S` more, then reaps: `CLOSE_S` (9 s) at most in all, whatever state the workers are in.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import socket
import struct
import time
from multiprocessing.connection import Connection, wait
from typing import Any

import attrs
import torch

from rlgraph.plan.plan import Plan
from rlgraph.runtime.errors import WorkerFailure
from rlgraph.runtime.worker_pool import DEFAULT_TIMEOUT_S, WorkerPool, resolve_device, start_worker
from rlgraph.user_files import UserFileError, loaded_files, unpickle

__all__ = ["SpmdTransport", "resolve_device", "free_port", "worker_context"]

GRACE_S = 5.0  # an idle worker told to close exits in well under 1 s (it drops its process group); 5 s covers a loaded machine
TERM_S = 2.0  # SIGTERM's default action ends a process at once; 2 s covers scheduling on a loaded machine
KILL_WAIT_S = 2.0  # SIGKILL cannot be caught or blocked (it ends a stopped process too): this only covers reaping
CLOSE_S = GRACE_S + TERM_S + KILL_WAIT_S  # the bound on `close`
# What the fork server imports before it forks any worker: the imports that dominate a rank's start and
# read nothing of a run when imported (a module it cannot import is skipped, as multiprocessing does).
PRELOAD = ("torch", "torch.distributed", "transformers", "transformers.models.qwen2.modeling_qwen2", "peft")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class SpmdTransport(WorkerPool):
    """`plan.mesh.size` worker processes; `world.build(rank, plan, device)` makes each one's executor."""

    def __init__(self, plan: Plan, world: Any, *, device: str = "auto", timeout_s: float | None = None,
                 threads_per_worker: int | None = None):
        self.device = resolve_device(device)
        self.world = plan.mesh.size
        if self.device == "cuda" and self.world > torch.cuda.device_count():
            raise WorkerFailure(f"the plan's mesh has {self.world} ranks but this machine has "
                                f"{torch.cuda.device_count()} GPU(s); compile for a mesh of at most that many")
        self.timeout_s = timeout_s if timeout_s is not None else DEFAULT_TIMEOUT_S[self.device]
        threads = threads_per_worker or max(1, (os.cpu_count() or 1) // self.world)
        world = attrs.evolve(world, rewards={})  # reward functions run on the controller, and need not pickle
        context = worker_context()
        master = ("127.0.0.1", free_port())
        # Sent as bytes and rebuilt inside the worker's own error handling, after the user's files loaded
        # there: a module it cannot import is a failure naming the rank, not a raw spawn traceback.
        recipe, files = pickle.dumps((plan, world), protocol=pickle.HIGHEST_PROTOCOL), loaded_files()
        self.connections: list[Connection] = []
        self.processes: list[mp.Process] = []
        self._init_pool(world)
        for rank in range(self.world):
            ours, theirs = context.Pipe()
            _send_timeout(ours, self.timeout_s)
            process = context.Process(target=_worker_main, name=f"rlgraph-rank{rank}", daemon=True,
                                      args=(dict(os.environ), rank, self.world, master, recipe, files, self.device, self.timeout_s, threads, theirs))
            process.start()
            theirs.close()
            self.connections.append(ours)
            self.processes.append(process)
            self.outstanding[rank].append(("start", None, None))
        try:
            self._wait_started()
        except BaseException:
            self.close()
            raise

    def _post(self, rank: int, command: str, args: tuple) -> None:
        _send(self.connections[rank], (command, args))

    def _poll(self, ranks: list[int], timeout: float) -> list[tuple[int, str, Any]]:
        by_connection = {self.connections[rank]: rank for rank in ranks}
        by_sentinel = {self.processes[rank].sentinel: rank for rank in ranks}
        answers, seen = [], set()
        for item in wait([*by_connection, *by_sentinel], timeout=timeout):
            rank = by_connection.get(item, by_sentinel.get(item))
            if rank in seen:
                continue
            seen.add(rank)
            connection = self.connections[rank]
            if item is connection or connection.poll():  # a worker may answer just before it exits
                try:
                    answers.append((rank, *_receive(connection)))
                except (EOFError, OSError):  # the pipe closed (EOF) or was reset under a killed worker
                    answers.append((rank, "died", self._exit(rank)))
            else:
                answers.append((rank, "died", self._exit(rank)))
        return answers

    def _dead(self) -> dict[int, str]:
        return {rank: self._exit(rank) for rank, process in enumerate(self.processes) if not process.is_alive()}

    def _exit(self, rank: int) -> str:
        process = self.processes[rank]
        process.join(timeout=1.0)
        code = process.exitcode
        if code is None:
            return "still running"
        if code < 0:
            return f"killed by signal {signal.Signals(-code).name}"
        return f"exit code {code}"

    def _unresponsive(self, ranks: list[int]) -> dict[int, str]:
        found = {}
        for rank in ranks:
            state = _process_state(self.processes[rank].pid)
            if state in ("T", "t"):  # a blocked or computing process is R, S or D; a stopped one never answers
                found[rank] = f"its process {self.processes[rank].pid} is stopped {_STOPPED[state]}"
        return found

    def _stop(self) -> None:
        """A `close` to every idle worker; SIGTERM to what is left after the grace, then SIGKILL; all bounded."""
        # Children first, while their parents still hold them (an orphan is re-parented and lost to the search).
        family = [pid for process in self.processes if process.pid for pid in _descendants(process.pid)]
        for rank, connection in enumerate(self.connections):
            if not self.outstanding[rank]:  # a busy (or stuck) worker would read `close` only after its work
                _reply(connection, "close", ())  # (a send that ignores a pipe already closed)
        _join(self.processes, GRACE_S)
        alive = [process.pid for process in self.processes if process.is_alive()]
        _signal(alive + family, signal.SIGTERM)
        _signal(alive + family, signal.SIGCONT)  # a stopped process acts on its pending SIGTERM once continued
        _join(self.processes, TERM_S)
        _signal([process.pid for process in self.processes if process.is_alive()] + family, signal.SIGKILL)
        _join(self.processes, KILL_WAIT_S)
        for process in self.processes:
            if process.is_alive():  # survived SIGKILL (uninterruptible sleep in a driver): multiprocessing's
                mp.process._children.discard(process)  # exit hook would join it without a bound
        for connection in self.connections:
            connection.close()


# -- the worker process ------------------------------------------------------------------------------


def _worker_main(environ: dict[str, str], rank: int, world: int, master: tuple[str, int], recipe: bytes, files: dict[str, str], device: str,
                 timeout_s: float, threads: int, connection: Connection) -> None:
    os.environ.clear()  # the controller's, as the pool started: the fork server's is as it was when *it* started
    os.environ.update(environ)
    import torch.distributed as dist

    from rlgraph.runtime.worker import describe_error, serve

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the controller, which stops us
    torch.set_num_threads(threads)
    try:
        plan, spec = unpickle(recipe, files, f"rank {rank}")
        worker = start_worker(rank, world, master, plan, spec, device, timeout_s, local_device=rank)
    except BaseException as error:  # noqa: BLE001 - a failure to start is reported like any other
        _reply(connection, "error", describe_error(error))
        return
    _reply(connection, "ok", (None, 0.0))
    while True:
        try:
            message = connection.recv_bytes()
        except (EOFError, OSError):
            break  # the controller went away
        try:
            command, args = unpickle(message, {}, f"rank {rank}")
        except UserFileError as error:  # a command naming code this process cannot import: its answer
            _reply(connection, "error", describe_error(error))
            continue
        if command == "close":
            break
        _reply(connection, *serve(worker, command, args))
    close = getattr(worker.executor, "close", None)
    if close is not None:
        close()  # engines that joined the process group leave it first (vLLM's ends the group too)
    if dist.is_initialized():
        dist.destroy_process_group()


def _reply(connection: Connection, status: str, payload: Any) -> None:
    try:
        _send(connection, (status, payload))
    except (BrokenPipeError, OSError):
        pass


def _send(connection: Connection, message: Any) -> None:
    """Plain pickling: tensors travel by value in the message. (`Connection.send` would use
    torch's multiprocessing reducers, which move every tensor to shared memory: ~1 ms each.)"""
    connection.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _receive(connection: Connection) -> Any:
    return pickle.loads(connection.recv_bytes())


# -- processes: state, children, signals (Linux /proc; elsewhere none are seen) ---------------------------

_STOPPED = {"T": "by SIGSTOP or Ctrl-Z (SIGCONT resumes it)", "t": "by a debugger or tracer"}


def _process_state(pid: int | None) -> str:
    """The one-letter state of process `pid` (R running, S sleeping, T stopped, ...); "" if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]  # the name in parentheses may hold spaces
    except (OSError, IndexError):
        return ""


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, their children, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # exited meanwhile
            children.setdefault(parent, []).append(int(entry))
    found, frontier = [], [pid]
    while frontier:
        below = children.get(frontier.pop(), [])
        found += below
        frontier += below
    return found


def _signal(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass  # already gone (and reaped): nothing to stop


def _join(processes: list[mp.Process], seconds: float) -> None:
    """Reap the processes that end within `seconds` in all (one deadline, not one per process)."""
    deadline = time.monotonic() + seconds
    for process in processes:
        if process.pid is not None:
            process.join(timeout=max(0.0, deadline - time.monotonic()))


def _send_timeout(connection: Connection, seconds: float) -> None:
    """A send to a worker that does not read (stopped, stuck) fails after `seconds` instead of blocking
    once the pipe is full (`Pipe()` is a socket pair: SO_SNDTIMEO bounds each blocked write)."""
    sock = socket.socket(fileno=os.dup(connection.fileno()))
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(seconds), int(seconds % 1 * 1e6)))
    finally:
        sock.close()


def worker_context() -> mp.context.ForkServerContext:
    """The multiprocessing context workers start from: the fork server, with `PRELOAD` imported."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))
    return context
