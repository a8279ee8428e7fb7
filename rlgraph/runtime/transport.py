"""Transports: how the plan runner reaches the ranks of a worker group.

The runner (`rlgraph.runtime.plan_runner`) walks the plan and decides everything: which nodes run
where, which value moves from which layout to which. A transport only carries it out:

| call | meaning |
| --- | --- |
| `load(key, program)` | every worker keeps the lowered program's nodes |
| `begin(bindings)` | a new iteration; `bindings[rank]` are that rank's inputs (model versions) |
| `run(key, ranks, names)` | the ranks of a group evaluate nodes `names` on the pieces they hold |
| `scatter(name, value, layout)` | controller -> ranks: each rank gets its piece of `value` under `layout` |
| `gather(name, layout)` | ranks -> controller: the whole value from the pieces |
| `move(source, name, src, dst, kind, per_row)` | ranks -> ranks: the collective `kind` |
| `sync_weights(name, source, route)` | the generation engines of `route.dst` get the weights trained on `route.src` |
| `offload(ranks, role, direction)` | optimizer state and gradients leave the device, or come back |
| `fetch(name, rank)` | one rank's value (a model version, update statistics) |

`LocalTransport` runs every rank in this process with one `Worker`: a layout's pieces are all the
whole value, so moves are renames; values cross between the controller (CPU) and the executor's
device at scatters, gathers and fetches, as they do between processes.
`rlgraph.runtime.spmd.SpmdTransport` runs one worker process per rank;
`rlgraph.runtime.collectives` is the reference both agree with.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import attrs

from rlgraph.backends.protocols import Executor
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


class Transport(Protocol):
    world: int

    def load(self, key: str, program: Program) -> None: ...

    def begin(self, bindings: Mapping[int, Mapping[str, Any]]) -> None: ...

    def run(self, key: str, ranks: tuple[int, ...], names: tuple[str, ...]) -> None: ...

    def scatter(self, name: str, value: Any, layout: tuple) -> None: ...

    def gather(self, name: str, layout: tuple) -> Any: ...

    def move(self, source: str, name: str, src: tuple, dst: tuple, kind: str, per_row: bool) -> None: ...

    def sync_weights(self, name: str, source: str, route: SyncRoute) -> None: ...

    def offload(self, ranks: tuple[int, ...], role: str, direction: str) -> None: ...

    def fetch(self, name: str, rank: int) -> Any: ...

    def current(self, role: str, rank: int) -> Any: ...

    def close(self) -> None: ...


class LocalTransport:
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
        self.worker.begin(merged)

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
        self.worker.offload(role, direction)

    def fetch(self, name: str, rank: int) -> Any:
        return self.worker.get(name)

    def current(self, role: str, rank: int) -> Any:
        return self.executor.current(role)

    def close(self) -> None:
        pass
