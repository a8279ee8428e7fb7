"""What the trainer steps: one program, iteration after iteration, with the state a checkpoint keeps.

A `Runner` is bound to one program when it is made, so `run(batch)` is all a step needs. Two kinds:
- `PlanRunner` (`runtime/plan_runner.py`): a compiled plan over a transport (local, spmd, Ray);
  every `rlgraph train` step and evaluation.
- `EagerRunner` (here): the traced program through the eager `Interpreter`, the reference every plan
  is tested against; tests and tools that run a program without compiling it step it with this.

Every runner answers the same calls, so the trainer (`rlgraph.train.loop`) asks nothing about which
it holds: a synchronous runner has no batches in flight to save, and refuses a checkpoint holding some.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from rlgraph.backends.protocols import Executor
from rlgraph.errors import RLGraphError
from rlgraph.ir.program import Program
from rlgraph.runtime.eager import Interpreter
from rlgraph.runtime.refill import MorePrompts


class Runner:
    """One program's iterations: `run(batch)` -> `(state, metrics)`; `carried` holds the `state.carry`
    scalars fed back each iteration; `outputs` the last iteration's `outputs`."""

    carried: dict[str, torch.Tensor]
    outputs: dict[str, Any]

    def run(self, batch: Any, *, more_prompts: MorePrompts | None = None) -> tuple[dict[str, Any], dict[str, float]]:
        raise NotImplementedError

    def export_state(self) -> Any:
        """The roles' weights and optimizer states and the random streams, for a checkpoint."""
        raise NotImplementedError

    def import_state(self, state: Any, where: str = "the checkpoint") -> None:
        raise NotImplementedError

    def export_in_flight(self) -> dict[str, Any] | None:
        """Batches generated ahead and not trained yet (asynchronous RL), as plain data; None: synchronous."""
        return None

    def import_in_flight(self, data: Mapping[str, Any] | None, where: str = "the checkpoint") -> None:
        """Put back what `export_in_flight` saved; a synchronous runner has nowhere to put batches in flight."""
        saved = (data or {}).get("in_flight", [])
        if saved:
            raise RLGraphError(f"{where} holds {len(saved)} batch(es) in flight (asynchronous RL), but this plan is "
                               "synchronous; resume it with the staleness it was saved with")


class EagerRunner(Runner):
    """`program` through the eager interpreter on `executor`, in this process: no plan, no transport."""

    def __init__(self, program: Program, executor: Executor):
        self.program = program
        self.interpreter = Interpreter(executor)

    @property
    def carried(self) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return self.interpreter.carried

    @carried.setter
    def carried(self, values: dict[str, torch.Tensor]) -> None:  # a resume puts back the checkpoint's
        self.interpreter.carried = values

    @property
    def outputs(self) -> dict[str, Any]:  # type: ignore[override]
        return self.interpreter.outputs

    def run(self, batch: Any, *, more_prompts: MorePrompts | None = None) -> tuple[dict[str, Any], dict[str, float]]:
        return self.interpreter.run(self.program, batch, more_prompts=more_prompts)

    def export_state(self) -> Any:
        return self.interpreter.executor.export_state()

    def import_state(self, state: Any, where: str = "the checkpoint") -> None:
        self.interpreter.executor.import_state(state, where)
