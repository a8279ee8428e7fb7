"""One rank's side of a running plan: its executor and the values it holds.

A `Worker` is what a transport reaches on each rank. The plan runner (on the controller) tells it,
step by step, to run a stage's nodes, to take a value from the controller (a scatter or broadcast
piece), to hand one back (a gather), to move one to other ranks (all_to_all, send_recv), to sync
weights or to offload; the worker never decides what to run. Its values live in `store`, keyed by
program node name, each being the piece of the value this rank holds under the node's layout.

The same class serves every transport: the local transport calls it directly in the controller's
process (one worker playing every rank, so every piece is the whole value); the spmd and ray
transports run one per rank and call it through a pipe or an actor call (`serve`).
"""

from __future__ import annotations

import functools
import time
import traceback
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx

from rlgraph.backends.protocols import Executor, ModelRef
from rlgraph.batches import to_device
from rlgraph.ir.program import Program
from rlgraph.runtime.eager import call_primitive, run_node


class Worker:
    """Holds the roles the plan places on `rank` (in `executor`) and this rank's pieces of values."""

    def __init__(self, executor: Executor, rank: int = 0):
        self.executor = executor
        self.rank = rank
        self._primitive = functools.partial(call_primitive, executor)  # a stage's primitives run on this rank's executor
        self.programs: dict[str, dict[str, fx.Node]] = {}
        self.store: dict[str, Any] = {}

    # -- the program -------------------------------------------------------------------------
    def load(self, key: str, program: Program) -> None:
        """Keep `program`'s nodes under `key`; stages name nodes of a loaded program."""
        self.programs[key] = {node.name: node for node in program.graph.nodes}

    def begin(self, bindings: Mapping[str, Any], keep: tuple[str, ...] = ()) -> None:
        """Start an iteration: drop the last one's values but those named in `keep` (batches still
        in flight, asynchronous RL), bind inputs (model versions, ...)."""
        self.store = {**{name: self.store[name] for name in keep if name in self.store}, **bindings}

    def run(self, key: str, names: tuple[str, ...]) -> None:
        """Evaluate the nodes `names` of program `key`, in order, on the pieces this rank holds."""
        nodes = self.programs[key]
        env = _StoreView(self.store)
        for name in names:
            self.store[name] = run_node(nodes[name], env, self._primitive)

    # -- values ------------------------------------------------------------------------------
    def put(self, name: str, value: Any) -> None:
        """Keep a value from the controller, on this rank's device (worker-side values live there)."""
        self.store[name] = to_device(value, self.executor.device)

    def get(self, name: str) -> Any:
        """A value for the controller, whose values live on the CPU."""
        return to_device(self.store[name], torch.device("cpu"))

    def alias(self, name: str, source: str) -> None:
        """`name` holds the same piece as `source` (a move whose layouts collapse on one worker)."""
        self.store[name] = self.store[source]

    def current(self, role: str) -> ModelRef:
        return self.executor.current(role)

    def sync_weights(self, name: str, source: str | None, route: Any) -> None:
        """Run a `sync_weights` node: the generation engine of this rank gets the weights of the
        version in `source` (None on a rank that only receives them)."""
        model = self.store.get(source) if source is not None else None
        self.store[name] = self.executor.sync_weights(model, route)


    # -- what needs the process group (spmd and Ray workers) ------------------------------------
    def move(self, source: str, name: str, src: tuple, dst: tuple, kind: str, per_row: bool) -> None:
        """This rank's part of a rank-to-rank collective (`runtime/distributed.py`)."""
        from rlgraph.runtime.distributed import move_distributed

        piece, _ = move_distributed(self.store.get(source), src, dst, kind, per_row=per_row)
        if piece is not None:
            self.store[name] = piece

    def offload(self, role: str, direction: str) -> None:
        self.executor.offload(role, direction)

    def full_state(self, role: str) -> dict[str, torch.Tensor] | None:
        return self.executor.full_state(role)

    def save_weights(self, role: str, path: str) -> str | None:
        return self.executor.save_weights(role, path)

    def set_learning_rate(self, role: str, lr: float) -> bool:
        return self.executor.set_learning_rate(role, lr)

    def weights_report(self, role: str) -> dict[str, Any]:
        return self.executor.weights_report(role)

    def export_state(self) -> Any:
        return self.executor.export_state()

    def import_state(self, state: Any, where: str) -> None:
        self.executor.import_state(state, where)

    def write_parts(self, directory: str) -> dict[str, Any]:
        return self.executor.write_parts(directory)

    def read_parts(self, directory: str, roles: Any, shuffle_rng: Any, sampling: Any, where: str) -> None:
        self.executor.read_parts(directory, roles, shuffle_rng, sampling, where)

    def executor_command(self, name: str, args: tuple, kwargs: Mapping[str, Any]) -> Any:
        """A command the executor declares in `commands` (the training service's tenant commands,
        `rlgraph.service.host`): the runtime carries it to every rank without knowing it."""
        if name not in getattr(self.executor, "commands", ()):
            raise KeyError(f"rank {self.rank}'s executor ({type(self.executor).__name__}) has no command {name!r}")
        return getattr(self.executor, name)(*args, **kwargs)


def serve(worker: Worker, command: str, args: tuple) -> tuple[str, Any]:
    """Run one command: `("ok", (result, seconds))`, or `("error", (type, message, traceback))`.

    Every failure goes back to the controller as data: a worker never dies of a user's mistake.
    """
    start = time.perf_counter()
    try:
        result = getattr(worker, command)(*args)
    except BaseException as error:  # noqa: BLE001
        return "error", describe_error(error)
    return "ok", (result, time.perf_counter() - start)


def describe_error(error: BaseException) -> tuple[str, str, str]:
    """(type name, message, traceback): an exception as data that crosses a pipe or a Ray call."""
    return type(error).__name__, str(error), "".join(traceback.format_exception(error))


class _StoreView(dict):
    """`run_node` reads its inputs as `env[fx.Node]`; a worker keys its values by node name."""

    def __init__(self, store: dict[str, Any]):
        super().__init__()
        self.store = store

    def __getitem__(self, node: fx.Node) -> Any:
        return self.store[node.name]

