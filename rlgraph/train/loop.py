"""The trainer loop: run an algorithm's program step after step, with checkpoints and resume.

The loop owns no RL logic: every step is one run of the traced program by the interpreter
(the plan, once compiled). It owns the clock, the data, metrics history and checkpoints.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import torch

from rlgraph.ir.program import Program
from rlgraph.runtime.eager import Interpreter
from rlgraph.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint


@attrs.define
class Trainer:
    """`program` runs once per step on the batch `next_batch()` returns (and on more of them when
    the program's `rg.filter_groups` refills its batch).

    `sampler` (anything with `state_dict`/`load_state_dict`) is checkpointed with the models so a
    resumed run sees exactly the batches the uninterrupted run would have seen.
    """

    program: Program
    interpreter: Interpreter
    next_batch: Callable[[], Any]
    sampler: Any = None
    run_dir: Path | None = None
    checkpoint_every: int | None = None
    step: int = 0
    history: list[dict[str, float]] = attrs.field(factory=list)

    def resume(self) -> bool:
        """Load the latest checkpoint of `run_dir` if there is one; returns whether it did."""
        path = latest_checkpoint(self.run_dir) if self.run_dir else None
        if path is None:
            return False
        restored = load_checkpoint(path, self.interpreter)
        self.step = restored["step"]
        self.history = list(restored.get("history", []))
        if self.sampler is not None:
            self.sampler.load_state_dict(restored["sampler"])
        self.interpreter.carried = {name: torch.as_tensor(value) for name, value in restored.get("carried", {}).items()}
        return True

    def save(self) -> Path:
        assert self.run_dir is not None, "set run_dir to checkpoint"
        extra = {"history": self.history, "sampler": self.sampler.state_dict() if self.sampler is not None else None,
                 "carried": dict(self.interpreter.carried)}  # state.carry values (e.g. an adaptive KL coefficient)
        return save_checkpoint(self.run_dir, self.step, self.interpreter.export_state(), extra)

    def run_step(self) -> dict[str, float]:
        start = time.perf_counter()
        # next_batch is also the prompt source of a refill loop (rg.filter_groups): the sampler,
        # checkpointed with the models, sees every batch drawn, so a resumed run stays exact.
        _, metrics = self.interpreter.run(self.program, self.next_batch(), more_prompts=self.next_batch)
        metrics["time/step_s"] = time.perf_counter() - start
        self.step += 1
        self.history.append(metrics)
        if self.checkpoint_every and self.run_dir and self.step % self.checkpoint_every == 0:
            self.save()
        return metrics

    def run(self, *, steps: int | None = None, seconds: float | None = None,
            until: Callable[[dict[str, float]], bool] | None = None) -> Iterator[dict[str, float]]:
        """Yield each step's metrics until `steps` more steps, `seconds` elapsed or `until(metrics)`."""
        assert steps is not None or seconds is not None or until is not None, "give a stopping rule"
        start, done = time.perf_counter(), 0
        while True:
            if steps is not None and done >= steps:
                return
            if seconds is not None and time.perf_counter() - start >= seconds:
                return
            metrics = self.run_step()
            done += 1
            yield metrics
            if until is not None and until(metrics):
                return
