"""Transports: how the plan runner reaches the ranks of a worker group.

The runner (`rlgraph.runtime.plan_runner`) walks the plan and decides everything: which nodes run
where, which value moves from which layout to which. A transport only carries it out. `Transport`
lists every command the runner and the run (`rlgraph.train`) send; each transport implements all
of them (tests/runtime/test_transport.py checks the signatures):

| call | meaning |
| --- | --- |
| `load(key, program)` | every worker keeps the lowered program's nodes |
| `begin(bindings)` | a new iteration; `bindings[rank]` are that rank's inputs (model versions); the values of earlier iterations are dropped, but those some runner holds |
| `hold(owner, names)` | runner `owner` needs the values `names` across iterations (its batches in flight): every later `begin`, whichever runner sends it (an evaluation between steps), keeps them |
| `at_step(step)` | the plan step the next commands belong to (a later failure names it) |
| `run(key, ranks, names)` | the ranks of a group evaluate nodes `names` on the pieces they hold |
| `scatter(name, value, layout)` | controller -> ranks: each rank gets its piece of `value` under `layout` |
| `gather(name, layout)` | ranks -> controller: the whole value from the pieces |
| `move(source, name, src, dst, kind, per_row)` | ranks -> ranks: the collective `kind` |
| `sync_weights(name, source, route)` | the generation engines of `route.dst` get the weights trained on `route.src` |
| `offload(ranks, role, direction)` | optimizer state and gradients leave the device, or come back |
| `fetch(name, rank)` | one rank's value (a model version, update statistics) |
| `current(role, rank)` | the live version of `role` on `rank` |
| `flush()` | wait until every command sent so far has finished (the end of an iteration) |
| `busy_seconds()` | plan step index -> seconds the busiest rank has spent on that step's commands (remote workers: commands are pipelined, so the controller's clock sees only its waits; {} in one process) |
| `set_learning_rate(role, lr)` | every rank training `role` sets its optimizer's learning rate |
| `pull_state(role)` | `role`'s full weights, on the CPU |
| `save_weights(role, path)` | `role`'s full weights (a LoRA role's merged) written to a safetensors file where the role lives, none through the controller |
| `checkpoint_state()` / `restore_state(state, where)` | the full `ExecutorState`, out of or into the ranks |
| `write_state(directory)` / `read_state(directory, roles, shuffle_rng, sampling, where)` | each rank writes, or reads, its own rows of a checkpoint in parts (`rlgraph.backends.state_files`); `write_state` answers None where the ranks have no parts (one process: the full form is written) |
| `close()` | stop the workers (idempotent) |

`LocalTransport` runs every rank in this process with one `Worker`: a layout's pieces are all the
whole value, so moves are renames; values cross between the controller (CPU) and the executor's
device at scatters, gathers and fetches, as they do between processes.
`rlgraph.runtime.worker_pool.WorkerPool` implements the commands for remote workers (`SpmdTransport`:
processes, `RayTransport`: Ray actors); `rlgraph.runtime.collectives` is the reference they agree with.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from rlgraph.backends.protocols import Executor, ExecutorState, ModelRef
from rlgraph.errors import RLGraphError
from rlgraph.ir.program import Program
from rlgraph.runtime.worker import Worker


@attrs.frozen
class SyncRoute:
    """Where a `sync_weights` step moves `role`'s weights: trained on ranks `src`, generated on
    ranks `dst` (the same ranks when colocated), in `buckets` buckets of at most `bucket_bytes`."""

    role: str
    src: tuple[int, ...]
    dst: tuple[int, ...]
    buckets: int
    bucket_bytes: int

    @property
    def colocated(self) -> bool:
        return set(self.src) == set(self.dst)


class Transport(abc.ABC):
    """The commands of a transport (see the module's table). `world` is the number of ranks it
    runs (None: any plan, its ranks collapsed onto this process); `executor` is the executor in
    this process, which can run the controller's primitives (None for remote workers)."""

    world: int | None
    executor: Executor | None

    # -- one iteration of a plan ---------------------------------------------------------------
    @abc.abstractmethod
    def load(self, key: str, program: Program) -> None: ...

    @abc.abstractmethod
    def begin(self, bindings: Mapping[int, Mapping[str, Any]]) -> None: ...

    def hold(self, owner: str, names: tuple[str, ...]) -> None:
        """Every later `begin` keeps `names` on the workers, until `owner` holds others."""
        self._held[owner] = tuple(names)

    def _kept(self) -> tuple[str, ...]:
        """The names every runner sharing this transport holds: an iteration of one must not drop the
        batches another has in flight (the RL runner's, while an evaluation runs between steps)."""
        return tuple(dict.fromkeys(name for names in self._held.values() for name in names))

    @functools.cached_property
    def _held(self) -> dict[str, tuple[str, ...]]:
        return {}  # runner key -> the names it holds

    @abc.abstractmethod
    def at_step(self, step: Any) -> None: ...

    @abc.abstractmethod
    def run(self, key: str, ranks: tuple[int, ...], names: tuple[str, ...]) -> None: ...

    @abc.abstractmethod
    def scatter(self, name: str, value: Any, layout: tuple) -> None: ...

    @abc.abstractmethod
    def gather(self, name: str, layout: tuple) -> Any: ...

    @abc.abstractmethod
    def move(self, source: str, name: str, src: tuple, dst: tuple, kind: str, per_row: bool) -> None: ...

    @abc.abstractmethod
    def sync_weights(self, name: str, source: str, route: SyncRoute) -> None: ...

    @abc.abstractmethod
    def offload(self, ranks: tuple[int, ...], role: str, direction: str) -> None: ...

    @abc.abstractmethod
    def fetch(self, name: str, rank: int) -> Any: ...

    @abc.abstractmethod
    def current(self, role: str, rank: int) -> ModelRef: ...

    @abc.abstractmethod
    def flush(self) -> None: ...

    @abc.abstractmethod
    def busy_seconds(self) -> dict[int, float]: ...

    # -- the run's commands, between iterations ---------------------------------------------------
    @abc.abstractmethod
    def set_learning_rate(self, role: str, lr: float) -> None: ...

    @abc.abstractmethod
    def pull_state(self, role: str) -> dict[str, torch.Tensor]: ...

    @abc.abstractmethod
    def save_weights(self, role: str, path: str) -> str: ...

    @abc.abstractmethod
    def checkpoint_state(self) -> ExecutorState: ...

    @abc.abstractmethod
    def restore_state(self, state: ExecutorState, where: str = "the checkpoint") -> None: ...

    @abc.abstractmethod
    def write_state(self, directory: str) -> dict[str, Any] | None: ...

    @abc.abstractmethod
    def read_state(self, directory: str, roles: Mapping[str, Any], shuffle_rng: Any, sampling: Mapping[str, Any],
                   where: str = "the checkpoint") -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...


class LocalTransport(Transport):
    """Every rank of the plan played by one in-process worker holding whole values."""

    world = None  # any plan: its ranks all collapse onto this process

    def __init__(self, executor: Executor):
        self.worker = Worker(executor)
        self.executor = executor

    def load(self, key: str, program: Program) -> None:
        self.worker.load(key, program)

    def begin(self, bindings: Mapping[int, Mapping[str, Any]]) -> None:
        merged: dict[str, Any] = {}
        for values in bindings.values():
            merged.update(values)
        self.worker.begin(merged, self._kept())

    def at_step(self, step: Any) -> None:
        pass  # every command runs as it is sent: a failure is raised within its own step

    def run(self, key: str, ranks: tuple[int, ...], names: tuple[str, ...]) -> None:
        self.worker.run(key, names)

    def scatter(self, name: str, value: Any, layout: tuple) -> None:
        self.worker.put(name, value)  # to the executor's device: a CUDA run keeps worker-side values there

    def gather(self, name: str, layout: tuple) -> Any:
        return self.worker.get(name)  # back to the CPU, where the controller's values live

    def move(self, source: str, name: str, src: tuple, dst: tuple, kind: str, per_row: bool) -> None:
        self.worker.alias(name, source)

    def sync_weights(self, name: str, source: str, route: SyncRoute) -> None:
        self.worker.sync_weights(name, source, route)

    def offload(self, ranks: tuple[int, ...], role: str, direction: str) -> None:
        # One process: every role keeps its device for the whole iteration (the local executor has
        # no second copy to make room for); offloading is the FSDP2 workers' (`FSDPExecutor.offload`).
        pass

    def fetch(self, name: str, rank: int) -> Any:
        return self.worker.get(name)

    def current(self, role: str, rank: int) -> ModelRef:
        return self.executor.current(role)

    def flush(self) -> None:
        pass  # nothing is pipelined in one process

    def busy_seconds(self) -> dict[int, float]:
        return {}  # every command runs as it is sent: the controller's clock times it

    def set_learning_rate(self, role: str, lr: float) -> None:
        self.executor.set_learning_rate(role, lr)

    def pull_state(self, role: str) -> dict[str, torch.Tensor]:
        """A CPU copy of `role`'s weights (the live ones stay with the executor)."""
        if role not in self.executor.models:
            raise RLGraphError(f"pull_state: this executor holds no role {role!r}; it holds {', '.join(self.executor.models)}")
        module = self.executor.models[role].model
        return {name: value.detach().to("cpu", copy=True) for name, value in module.state_dict().items()}

    def save_weights(self, role: str, path: str) -> str:
        """`role`'s weights as one safetensors file at `path` (a LoRA role's adapters merged into its
        base: the plain model); returns the path."""
        from rlgraph.backends.fsdp.loading import write_weights
        from rlgraph.backends.lora import is_lora, merged_state_dict

        if role not in self.executor.models:
            raise RLGraphError(f"save_weights: this executor holds no role {role!r}; it holds {', '.join(self.executor.models)}")
        module = self.executor.models[role].model
        return str(write_weights(merged_state_dict(module) if is_lora(module) else module.state_dict(), path))

    def checkpoint_state(self) -> ExecutorState:
        return self.executor.export_state()

    def restore_state(self, state: ExecutorState, where: str = "the checkpoint") -> None:
        self.executor.import_state(state, where)

    def write_state(self, directory: str) -> dict[str, Any] | None:
        return None  # one process holds every role whole: the checkpoint is written in the full form

    def read_state(self, directory: str, roles: Mapping[str, Any], shuffle_rng: Any, sampling: Mapping[str, Any],
                   where: str = "the checkpoint") -> None:
        """One process holds every role whole: the parts put together (a checkpoint of any rank count)."""
        from pathlib import Path

        from rlgraph.backends.state_files import full_state, refuse_non_finite

        state = full_state(Path(directory), roles, shuffle_rng, sampling)
        for role, held in state.roles.items():
            refuse_non_finite(held.model, role, where)
        self.executor.import_state(state, where)

    def close(self) -> None:
        pass  # the executor belongs to the caller
