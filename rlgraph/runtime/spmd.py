"""The `spmd` transport: one worker process per mesh rank on this machine, torch.distributed between them.

    transport = SpmdTransport(compiled.plan, world, device="cpu")     # starts len(mesh) processes
    runner = PlanRunner(compiled, transport, controller=world.controller())
    ...
    transport.close()                                                 # or `with SpmdTransport(...)`

The controller (this process) is not a rank: it talks to each worker over a pipe, sending the
commands of `rlgraph.runtime.transport` and the controller's pieces of values (pickled; they are
small next to the models). Workers talk to each other with torch.distributed (gloo on CPU, NCCL on
CUDA, rendezvous on a free local port): FSDP2's collectives, the plan's rank-to-rank moves
(`rlgraph.runtime.distributed.move_distributed`) and weight syncs.

Failures never hang the controller: every wait is on the workers' pipes and their process
sentinels together, with a timeout (default 60 s on CPU, 600 s on CUDA). A worker that raises
sends its error back; one that dies is seen by its sentinel; one that does not answer in time
is reported with the ranks still missing. Each becomes a `WorkerFailure` that the plan runner
turns into an error naming the step, stage, role and rank; every worker is then stopped.
Workers ignore Ctrl-C (the controller stops them), so an interrupt leaves one clean message.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import socket
import time
import traceback
from collections import deque
from collections.abc import Callable, Mapping
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import attrs
import torch

from rlgraph.ir.program import Program
from rlgraph.plan.plan import Plan
from rlgraph.runtime import collectives as C
from rlgraph.runtime.plan_runner import WorkerFailure
from rlgraph.runtime.transport import SyncRoute

DEFAULT_TIMEOUT_S = {"cpu": 60.0, "cuda": 600.0}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def resolve_device(device: str) -> str:
    """`auto` -> cuda when a GPU is present, else cpu; `cuda` without a GPU is refused."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise WorkerFailure("device 'cuda' was asked for, but torch sees no CUDA GPU here; use --device cpu or auto")
    return device


class SpmdTransport:
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
        context = mp.get_context("spawn")
        port = free_port()
        self.connections: list[Connection] = []
        self.processes: list[mp.Process] = []
        for rank in range(self.world):
            ours, theirs = context.Pipe()
            process = context.Process(target=_worker_main, name=f"rlgraph-rank{rank}", daemon=True,
                                      args=(rank, self.world, port, plan, world, self.device, self.timeout_s, threads, theirs))
            process.start()
            theirs.close()
            self.connections.append(ours)
            self.processes.append(process)
        self._closed = False
        self._step: Any = None
        self.step_busy: dict[int, list[float]] = {}  # plan step index -> seconds each rank spent on its commands
        self.outstanding: list[deque] = [deque() for _ in range(self.world)]  # (what, step) sent, not yet answered
        for rank in range(self.world):
            self.outstanding[rank].append(("start", None))
        self.busy_s = [0.0] * self.world  # seconds each worker spent running commands (the controller overhead's complement)
        try:
            self._wait(range(self.world))  # each worker built its roles (or said why not)
        except BaseException:
            self.close()
            raise

    # -- commands ------------------------------------------------------------------------------
    def at_step(self, step: Any) -> None:
        """The plan step the next commands belong to (named in a failure that surfaces later)."""
        self._step = step

    def _call(self, calls: Mapping[int, tuple[str, tuple]], what: str, *, wait: bool = True) -> dict[int, Any]:
        """Send each rank its command; with `wait`, return every answer (or raise the first failure).

        Commands whose answer the controller does not need (`wait=False`) are not waited for: a
        worker runs them in order while the controller goes on, and their answers (or a failure,
        still naming its own step) are read at the next wait for that rank, at the latest at the
        end of the iteration (`flush`).
        """
        if self._closed:
            raise WorkerFailure("the spmd workers were stopped after an earlier failure; start a new transport")
        for rank, (command, args) in calls.items():
            try:
                _send(self.connections[rank], (command, args))
            except (BrokenPipeError, OSError):
                self._fail(WorkerFailure(f"rank {rank} is gone ({self._exit(rank)}) before {what}", rank, step=self._step))
            self.outstanding[rank].append((what, self._step))
        return self._wait(calls) if wait else {}

    def flush(self) -> None:
        """Wait for every command sent so far (the end of an iteration)."""
        self._wait([rank for rank in range(self.world) if self.outstanding[rank]])

    def _wait(self, ranks) -> dict[int, Any]:
        """Read each rank's answers up to its last command; returns the last answers."""
        pending = {self.connections[rank]: rank for rank in ranks if self.outstanding[rank]}
        sentinels = {self.processes[rank].sentinel: rank for rank in pending.values()}
        results: dict[int, Any] = {}
        while pending:
            ready = wait([*pending, *sentinels], timeout=self.timeout_s)
            if not ready:
                missing = sorted(pending.values())
                what, step = self.outstanding[missing[0]][0]
                self._fail(WorkerFailure(
                    f"rank(s) {missing} did not finish {what} within {self.timeout_s:.0f} s (a collective waiting for a "
                    "peer, or a stuck worker); raise the timeout with timeout_s= / --timeout if the step is just slow",
                    missing[0] if len(missing) == 1 else None, step=step))
            for item in ready:
                if item in pending:
                    rank = pending[item]
                    what, step = self.outstanding[rank].popleft()
                    results[rank] = self._answer(item, rank, what, step)
                    if not self.outstanding[rank]:
                        del pending[item]
                        sentinels = {s: r for s, r in sentinels.items() if r != rank}
                elif item in sentinels and sentinels[item] in pending.values():
                    rank = sentinels[item]
                    if not self.connections[rank].poll():  # it may have answered just before exiting
                        what, step = self.outstanding[rank][0]
                        self._fail(WorkerFailure(f"rank {rank} died during {what} ({self._exit(rank)})", rank, step=step))
        return results

    def _answer(self, connection: Connection, rank: int, what: str, step: Any) -> Any:
        try:
            status, payload = _receive(connection)
        except (EOFError, OSError):  # the pipe closed (EOF) or was reset under a killed worker
            self._fail(WorkerFailure(f"rank {rank} died during {what} ({self._exit(rank)})", rank, step=step))
        if status == "error":
            name, message, remote = payload
            dead = [other for other, process in enumerate(self.processes) if other != rank and not process.is_alive()]
            if dead:  # a collective broke because a peer died: the death is the cause to report
                self._fail(WorkerFailure(f"rank {dead[0]} died during {what} ({self._exit(dead[0])}); rank {rank}'s "
                                         f"collective then failed: {name}: {message.splitlines()[0][:200]}", dead[0], step=step))
            self._fail(WorkerFailure(f"rank {rank} raised {name} during {what}: {message}", rank, remote, step=step))
        if what == "start":
            return payload
        result, busy = payload
        self.busy_s[rank] += busy
        if step is not None:
            self.step_busy.setdefault(step.index, [0.0] * self.world)[rank] += busy
        return result

    def _exit(self, rank: int) -> str:
        process = self.processes[rank]
        process.join(timeout=1.0)
        code = process.exitcode
        if code is None:
            return "still running"
        if code < 0:
            return f"killed by signal {signal.Signals(-code).name}"
        return f"exit code {code}"

    def _fail(self, failure: WorkerFailure) -> None:
        self.close()
        raise failure

    def _all(self, ranks, command: str, *args: Any, wait: bool = True) -> dict[int, Any]:
        return self._call({rank: (command, args) for rank in ranks}, command, wait=wait)

    # -- the transport protocol ----------------------------------------------------------------
    def load(self, key: str, program: Program) -> None:
        self._all(range(self.world), "load", key, program)

    def begin(self, bindings: Mapping[int, Mapping[str, Any]]) -> None:
        self._call({rank: ("begin", (dict(bindings.get(rank, {})),)) for rank in range(self.world)}, "begin", wait=False)

    def run(self, key: str, ranks: tuple[int, ...], names: tuple[str, ...]) -> None:
        self._all(ranks, "run", key, names, wait=False)

    def scatter(self, name: str, value: Any, layout: tuple) -> None:
        pieces = C.shard(value, layout)
        self._call({rank: ("put", (name, piece)) for rank, piece in pieces.items()}, f"the scatter of {name}", wait=False)

    def gather(self, name: str, layout: tuple) -> Any:
        pieces = self._all(layout[0], "get", name)
        return C.unshard(pieces, layout)

    def move(self, source: str, name: str, src: tuple, dst: tuple, kind: str, per_row: bool) -> None:
        ranks = sorted(set(src[0]) | set(dst[0]))
        self._all(ranks, "move", source, name, src, dst, kind, per_row, wait=False)

    def sync_weights(self, name: str, source: str, route: SyncRoute) -> None:
        calls = {rank: ("sync_weights", (name, source if rank in route.src else None, route))
                 for rank in sorted(set(route.src) | set(route.dst))}
        self._call(calls, f"sync_weights of {route.role}", wait=False)

    def offload(self, ranks: tuple[int, ...], role: str, direction: str) -> None:
        self._all(ranks, "offload", role, direction, wait=False)

    def fetch(self, name: str, rank: int) -> Any:
        return self._all([rank], "get", name)[rank]

    def current(self, role: str, rank: int) -> Any:
        return self._all([rank], "current", role)[rank]

    def weights_report(self, role: str) -> dict[int, dict[str, Any]]:
        """Per rank: how much of `role` it holds and whether its engine matches the trained weights."""
        return self._all(range(self.world), "weights_report", role)

    def pull_state(self, role: str) -> dict[str, torch.Tensor]:
        """The full (unsharded) weights of `role`, on the CPU, from the ranks that train or hold it."""
        states = self._all(range(self.world), "full_state", role)
        return next(state for state in states.values() if state is not None)

    def close(self) -> None:
        """Stop every worker: a polite `close`, then terminate whatever is left."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        for connection in self.connections:
            try:
                _send(connection, ("close", ()))
            except (BrokenPipeError, OSError):
                pass
        for process in self.processes:
            process.join(timeout=5.0)
            if process.is_alive():
                process.terminate()
                process.join(timeout=5.0)
        for connection in self.connections:
            connection.close()

    def __enter__(self) -> SpmdTransport:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


# -- the worker process ------------------------------------------------------------------------------


def _worker_main(rank: int, world: int, port: int, plan: Plan, spec: Any, device: str, timeout_s: float,
                 threads: int, connection: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the controller, which stops us
    torch.set_num_threads(threads)
    try:
        worker = _start(rank, world, port, plan, spec, device, timeout_s)
    except BaseException as error:  # noqa: BLE001 - every failure goes back to the controller as data
        _reply(connection, "error", _describe(error))
        return
    _reply(connection, "ok", None)
    _serve(worker, connection)


def _start(rank: int, world: int, port: int, plan: Plan, spec: Any, device: str, timeout_s: float):
    import torch.distributed as dist

    from rlgraph.runtime.worker import Worker

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    executor = spec.build(rank, plan, torch.device(device, rank) if device == "cuda" else torch.device("cpu"))
    return _SpmdWorker(Worker(executor, rank))


def _serve(worker: _SpmdWorker, connection: Connection) -> None:
    import torch.distributed as dist

    while True:
        try:
            command, args = _receive(connection)
        except (EOFError, OSError):
            break  # the controller went away
        if command == "close":
            break
        start = time.perf_counter()
        try:
            result = getattr(worker, command)(*args)
        except BaseException as error:  # noqa: BLE001
            _reply(connection, "error", _describe(error))
            continue
        _reply(connection, "ok", (result, time.perf_counter() - start))
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


def _describe(error: BaseException) -> tuple[str, str, str]:
    return type(error).__name__, str(error), traceback.format_exc()


class _SpmdWorker:
    """A `Worker` plus what needs the process group: rank-to-rank moves and pulling full weights."""

    def __init__(self, worker: Any):
        self.worker = worker

    def __getattr__(self, name: str) -> Callable[..., Any]:
        return getattr(self.worker, name)

    def move(self, source: str, name: str, src: tuple, dst: tuple, kind: str, per_row: bool) -> None:
        from rlgraph.runtime.distributed import move_distributed

        piece, _ = move_distributed(self.worker.store.get(source), src, dst, kind, per_row=per_row)
        if piece is not None:
            self.worker.store[name] = piece

    def offload(self, role: str, direction: str) -> None:
        self.worker.executor.offload(role, direction)

    def full_state(self, role: str) -> dict[str, torch.Tensor] | None:
        return self.worker.executor.full_state(role)

    def weights_report(self, role: str) -> dict[str, Any]:
        return self.worker.executor.weights_report(role)
