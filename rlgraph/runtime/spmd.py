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
reported with the ranks still missing (`rlgraph.runtime.pool`). Workers ignore Ctrl-C (the
controller stops them), so an interrupt leaves one clean message.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import socket
from multiprocessing.connection import Connection, wait
from typing import Any

import attrs
import torch

from rlgraph.plan.plan import Plan
from rlgraph.runtime.errors import WorkerFailure
from rlgraph.runtime.pool import DEFAULT_TIMEOUT_S, WorkerPool, resolve_device, start_worker

__all__ = ["SpmdTransport", "resolve_device", "free_port"]


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
        context = mp.get_context("spawn")
        master = ("127.0.0.1", free_port())
        self.connections: list[Connection] = []
        self.processes: list[mp.Process] = []
        self._init_pool(world)
        for rank in range(self.world):
            ours, theirs = context.Pipe()
            process = context.Process(target=_worker_main, name=f"rlgraph-rank{rank}", daemon=True,
                                      args=(rank, self.world, master, plan, world, self.device, self.timeout_s, threads, theirs))
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

    def _stop(self) -> None:
        """A polite `close` to every worker, then terminate whatever is left."""
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


# -- the worker process ------------------------------------------------------------------------------


def _worker_main(rank: int, world: int, master: tuple[str, int], plan: Plan, spec: Any, device: str, timeout_s: float,
                 threads: int, connection: Connection) -> None:
    import torch.distributed as dist

    from rlgraph.runtime.worker import describe_error, serve

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the controller, which stops us
    torch.set_num_threads(threads)
    try:
        worker = start_worker(rank, world, master, plan, spec, device, timeout_s, local_device=rank)
    except BaseException as error:  # noqa: BLE001 - a failure to start is reported like any other
        _reply(connection, "error", describe_error(error))
        return
    _reply(connection, "ok", (None, 0.0))
    while True:
        try:
            command, args = _receive(connection)
        except (EOFError, OSError):
            break  # the controller went away
        if command == "close":
            break
        _reply(connection, *serve(worker, command, args))
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
