"""What every remote transport shares: one worker per rank, commands in order, answers as data.

`WorkerPool` implements the transport protocol (`rlgraph.runtime.transport`) over abstract
"post a command to rank r" and "which ranks have answered" operations; `SpmdTransport` (pipes
to local processes) and `RayTransport` (Ray actors) supply those. The pool keeps, per rank, the
commands sent and not yet answered, so commands whose answer the controller does not need (a
stage, a scatter, a sync) are pipelined: a worker runs them in order while the controller goes
on, and their answers, or a failure still naming its own plan step, are read at the next wait for
that rank, at the latest at the end of the iteration (`flush`).

A failure is a `WorkerFailure` naming the rank and, once the runner adds it, the step, stage and
role. When a worker raises because a peer died or stopped answering in a collective, that peer is
reported as the cause. When nothing answers within the timeout, the ranks named are those that
still owe an answer, narrowed to the ones whose process no longer runs (stopped, hung) when there
are such: a healthy rank blocked in a collective waiting for a stopped one is never the one
blamed. After any failure every worker is stopped (`close`, bounded in time).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch

from rlgraph.backends.protocols import ExecutorState, ModelRef, RankRecipe
from rlgraph.errors import RLGraphError
from rlgraph.ir.program import Program
from rlgraph.runtime import collectives as C
from rlgraph.runtime.errors import WorkerFailure
from rlgraph.runtime.transport import SyncRoute, Transport

DEFAULT_TIMEOUT_S = {"cpu": 60.0, "cuda": 600.0}
START_TIMEOUT_S = 180.0  # starting workers (spawn, import torch, build models) is not a step: a loaded machine is slow


def resolve_device(device: str) -> str:
    """`auto` -> cuda when a GPU is present, else cpu; `cuda` without a GPU is refused."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise WorkerFailure("device 'cuda' was asked for, but torch sees no CUDA GPU here; use --device cpu or auto")
    return device


def start_worker(rank: int, world: int, master: tuple[str, int], plan: Any, spec: Any, device: str,
                 timeout_s: float, local_device: int = 0) -> Any:
    """Join the job's process group (gloo on CPU, NCCL on CUDA) and build rank `rank`'s `Worker`."""
    import torch.distributed as dist

    from rlgraph.runtime.worker import Worker

    # The launcher's variables too: vLLM's external_launcher reads them to join this process group.
    os.environ.update(MASTER_ADDR=master[0], MASTER_PORT=str(master[1]), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(local_device))
    if device == "cuda":
        torch.cuda.set_device(local_device)
    # The rendezvous is start-up, bounded like it (a loaded machine spawns slowly); the group's own
    # timeout, which bounds every collective, is the step timeout.
    store = dist.TCPStore(master[0], master[1], world, is_master=rank == 0,
                          timeout=timedelta(seconds=max(timeout_s, START_TIMEOUT_S)))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    executor = spec.build(rank, plan, torch.device("cuda", local_device) if device == "cuda" else torch.device("cpu"))
    return Worker(executor, rank)


class WorkerPool(Transport):
    """The transport protocol over `world` remote workers; subclasses say how to reach them.

    `recipe` built the workers' executors; the pool asks it to turn the ranks' shares of a role
    back into whole values (checkpoints, weights), so the pool never reads a backend's shard format.
    """

    world: int
    device: str
    timeout_s: float
    recipe: RankRecipe
    executor = None  # the executors live in the workers; the controller's is passed to the runner
    _closed = True  # until `_init_pool`: a pool that failed to start has nothing to stop

    def _init_pool(self, recipe: RankRecipe) -> None:
        self.recipe = recipe
        self._closed = False
        self._step: Any = None
        self.outstanding: list[deque] = [deque() for _ in range(self.world)]  # (what, step, token) not yet answered
        self.busy_s = [0.0] * self.world  # seconds each worker spent running commands
        self.step_busy: dict[int, list[float]] = {}  # plan step index -> seconds each rank spent on its commands

    # -- what a subclass provides ------------------------------------------------------------
    def _post(self, rank: int, command: str, args: tuple) -> Any:
        """Send a command to `rank` without waiting; returns a token for `_poll` (or None)."""
        raise NotImplementedError

    def _poll(self, ranks: list[int], timeout: float) -> list[tuple[int, str, Any]]:
        """Answers that arrived for the oldest outstanding command of some of `ranks`:
        `(rank, "ok" | "error", payload)` or `(rank, "died", how)`; [] after `timeout` seconds."""
        raise NotImplementedError

    def _dead(self) -> dict[int, str]:
        """Ranks whose worker is gone, with how (exit code, signal, node lost)."""
        raise NotImplementedError

    def _unresponsive(self, ranks: list[int]) -> dict[int, str]:
        """Those of `ranks` whose worker is alive but not running (stopped, hung), with what is seen;
        found within a few seconds. A rank busy computing or blocked in a collective is not one."""
        raise NotImplementedError

    def _stop(self) -> None:
        """End every worker, within a bounded time, whatever state it is in."""
        raise NotImplementedError

    # -- commands ------------------------------------------------------------------------------
    def at_step(self, step: Any) -> None:
        """The plan step the next commands belong to (named in a failure that surfaces later)."""
        self._step = step

    def _call(self, calls: Mapping[int, tuple[str, tuple]], what: str, *, wait: bool = True) -> dict[int, Any]:
        """Send each rank its command; with `wait`, return every answer (or raise the first failure)."""
        if self._closed:
            raise WorkerFailure("the workers were stopped after an earlier failure; start a new transport")
        for rank, (command, args) in calls.items():
            try:
                token = self._post(rank, command, args)
            except (BrokenPipeError, OSError):  # gone, or not reading its commands (a send has a timeout)
                how = self._dead().get(rank) or self._unresponsive([rank]).get(rank) or "not reading its commands"
                self._fail(WorkerFailure(f"rank {rank} could not be sent {what} ({how})", rank, step=self._step))
            self.outstanding[rank].append((what, self._step, token))
        return self._wait(list(calls)) if wait else {}

    def _all(self, ranks, command: str, *args: Any, wait: bool = True) -> dict[int, Any]:
        return self._call({rank: (command, args) for rank in ranks}, command, wait=wait)

    def flush(self) -> None:
        """Wait for every command sent so far (the end of an iteration)."""
        self._wait([rank for rank in range(self.world) if self.outstanding[rank]])

    def _wait_started(self) -> None:
        """Wait until every worker has built its roles (or said why not), with the start timeout."""
        step_timeout, self.timeout_s = self.timeout_s, max(self.timeout_s, START_TIMEOUT_S)
        try:
            self._wait(list(range(self.world)))
        finally:
            self.timeout_s = step_timeout

    def _wait(self, ranks: list[int]) -> dict[int, Any]:
        """Read each rank's answers up to its last command; returns the last answers."""
        pending = [rank for rank in ranks if self.outstanding[rank]]
        results: dict[int, Any] = {}
        while pending:
            answers = self._poll(pending, self.timeout_s)
            if not answers:
                self._fail(self._timed_out(pending))
            for rank, status, payload in answers:
                what, step, _ = self.outstanding[rank].popleft()
                results[rank] = self._answer(rank, status, payload, what, step)
                if not self.outstanding[rank]:
                    pending.remove(rank)
        return results

    def _timed_out(self, pending: list[int]) -> WorkerFailure:
        """The failure when no answer came within the timeout: it names the ranks at fault.

        Every rank that still owes an answer is a suspect, not only those waited on (a stopped rank
        may owe the answer to an earlier pipelined command while the wait is on a healthy rank
        blocked in a collective with it). Suspects whose process no longer runs are the cause.
        """
        silent = [rank for rank in range(self.world) if self.outstanding[rank]]
        stuck = self._unresponsive(silent)
        if stuck:
            rank = min(stuck)
            what, step, _ = self.outstanding[rank][0]
            if len(stuck) == 1:
                who, how = f"rank {rank}", stuck[rank]
            else:
                who, how = f"ranks {sorted(stuck)}", "; ".join(f"rank {r}: {how}" for r, how in sorted(stuck.items()))
            return WorkerFailure(
                f"{who} stopped answering: no answer to {what} within {self.timeout_s:.0f} s ({how}); "
                "the other ranks were waiting for it", rank if len(stuck) == 1 else None, step=step)
        what, step, _ = self.outstanding[pending[0]][0]
        return WorkerFailure(
            f"rank(s) {sorted(silent)} did not finish {what} within {self.timeout_s:.0f} s (a collective waiting "
            "for a peer, or a slow step); raise the timeout (timeout_s= / --timeout) if the step is just slow",
            silent[0] if len(silent) == 1 else None, step=step)

    def _answer(self, rank: int, status: str, payload: Any, what: str, step: Any) -> Any:
        if status == "died":
            self._fail(WorkerFailure(f"rank {rank} died during {what} ({payload})", rank, step=step))
        if status == "error":
            name, message, remote = payload
            first_line = message.splitlines()[0][:200] if message else ""
            dead = {other: how for other, how in self._dead().items() if other != rank}
            if dead:  # a collective broke because a peer died: the death is the cause to report
                other, how = next(iter(dead.items()))
                self._fail(WorkerFailure(f"rank {other} died during {what} ({how}); rank {rank}'s collective then "
                                         f"failed: {name}: {first_line}", other, step=step))
            # A peer that owes an answer and whose process no longer runs broke the collective (its timeout).
            stuck = self._unresponsive([other for other in range(self.world) if other != rank and self.outstanding[other]])
            if stuck:
                other, how = min(stuck.items())
                self._fail(WorkerFailure(f"rank {other} stopped answering during {self.outstanding[other][0][0]} ({how}); "
                                         f"rank {rank}'s collective then failed: {name}: {first_line}", other,
                                         step=self.outstanding[other][0][1]))
            self._fail(WorkerFailure(f"rank {rank} raised {name} during {what}: {message}", rank, remote, step=step))
        result, busy = payload
        self.busy_s[rank] += busy
        if step is not None:
            self.step_busy.setdefault(step.index, [0.0] * self.world)[rank] += busy
        return result

    def _fail(self, failure: WorkerFailure) -> None:
        self.close()
        raise failure

    # -- the transport protocol ----------------------------------------------------------------
    def load(self, key: str, program: Program) -> None:
        self._all(range(self.world), "load", key, program)

    def begin(self, bindings: Mapping[int, Mapping[str, Any]]) -> None:
        keep = self._kept()
        self._call({rank: ("begin", (dict(bindings.get(rank, {})), keep)) for rank in range(self.world)}, "begin",
                   wait=False)

    def run(self, key: str, ranks: tuple[int, ...], names: tuple[str, ...]) -> None:
        self._all(ranks, "run", key, names, wait=False)

    def scatter(self, name: str, value: Any, layout: tuple) -> None:
        pieces = C.shard(value, layout)
        self._call({rank: ("put", (name, piece)) for rank, piece in pieces.items()}, f"the scatter of {name}", wait=False)

    def gather(self, name: str, layout: tuple) -> Any:
        return C.unshard(self._all(layout[0], "get", name), layout)

    def move(self, source: str, name: str, src: tuple, dst: tuple, kind: str, per_row: bool) -> None:
        self._all(sorted(set(src[0]) | set(dst[0])), "move", source, name, src, dst, kind, per_row, wait=False)

    def sync_weights(self, name: str, source: str, route: SyncRoute) -> None:
        calls = {rank: ("sync_weights", (name, source if rank in route.src else None, route))
                 for rank in sorted(set(route.src) | set(route.dst))}
        self._call(calls, f"sync_weights of {route.role}", wait=False)

    def offload(self, ranks: tuple[int, ...], role: str, direction: str) -> None:
        self._all(ranks, "offload", role, direction, wait=False)

    def fetch(self, name: str, rank: int) -> Any:
        return self._all([rank], "get", name)[rank]

    def command(self, name: str, *args: Any, **kwargs: Any) -> dict[int, Any]:
        """Every rank runs its executor's command `name` (one it declares: `Worker.executor_command`);
        each rank's answer."""
        return self._all(range(self.world), "executor_command", name, args, kwargs)

    def current(self, role: str, rank: int) -> ModelRef:
        return self._all([rank], "current", role)[rank]

    def weights_report(self, role: str) -> dict[int, dict[str, Any]]:
        """Per rank: how much of `role` it holds and whether its engine matches the trained weights."""
        return self._all(range(self.world), "weights_report", role)

    def pull_state(self, role: str) -> dict[str, torch.Tensor]:
        """The full (unsharded) weights of `role`, on the CPU, from the ranks that train or hold it."""
        return self.recipe.full_weights(role, self._all(range(self.world), "full_state", role))

    def busy_seconds(self) -> dict[int, float]:
        """Plan step index -> seconds the busiest rank has spent on that step's commands, so far."""
        return {index: max(seconds) for index, seconds in self.step_busy.items()}

    def save_weights(self, role: str, path: str) -> str:
        """`role`'s full weights written to `path` by the first rank of its group (the others join the
        gather); nothing of them crosses to the controller."""
        written = [answer for answer in self._all(range(self.world), "save_weights", role, path).values() if answer]
        if not written:
            raise RLGraphError(f"save_weights: no rank holds role {role!r}")
        return written[0]

    def set_learning_rate(self, role: str, lr: float) -> None:
        """Every rank that trains `role` sets its optimizer's learning rate (a schedule, between steps)."""
        self._all(range(self.world), "set_learning_rate", role, lr)

    def checkpoint_state(self) -> ExecutorState:
        """The full `ExecutorState` of every rank's roles (weights gathered, optimizer shards merged)."""
        return self.recipe.merge_states(self._all(range(self.world), "export_state"))

    def restore_state(self, state: ExecutorState, where: str = "the checkpoint") -> None:
        """Every rank loads its shards of `state` (each checks the whole state before touching anything)."""
        self._all(range(self.world), "import_state", state, where)

    def write_state(self, directory: str) -> dict[str, Any] | None:
        """Every rank writes its own rows into `directory` (nothing is gathered or piped but a few
        numbers); the roles as the checkpoint's meta records them, and the random streams."""
        from rlgraph.backends.fsdp.state import sampling_stream

        parts = self._all(range(self.world), "write_parts", directory)
        roles = {role: held for part in parts.values() for role, held in part["roles"].items()}
        return {"roles": roles, "shuffle_rng": parts[0]["shuffle_rng"], "sampling": sampling_stream(parts)}

    def read_state(self, directory: str, roles: Mapping[str, Any], shuffle_rng: Any, sampling: Mapping[str, Any],
                   where: str = "the checkpoint") -> None:
        """Every rank reads its own rows of a checkpoint in parts (each checks all it holds first)."""
        self._all(range(self.world), "read_parts", directory, roles, shuffle_rng, sampling, where)

    def close(self) -> None:
        """Stop every worker (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._stop()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
