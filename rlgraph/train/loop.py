"""The trainer loop: run an algorithm's program step after step, with checkpoints and resume.

The loop owns no RL logic: every step is one `run(batch)` of a runner (`rlgraph.runtime.runner`:
the compiled plan's `PlanRunner`, or the eager reference's `EagerRunner`). It owns the clock, the
data, metrics history and checkpoints.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import torch

from rlgraph.plan.timing import STEP_SECONDS
from rlgraph.runtime.runner import Runner
from rlgraph.train.checkpoint import latest_checkpoint, load_checkpoint, prune_checkpoints, save_checkpoint


@attrs.frozen
class RunResult:
    """What a run gives back (`rlgraph.train.run.train`, continued pre-training alike): its directory,
    the steps and seconds of its loop, and the held-out evaluation before and after (None: none)."""

    run_dir: Path
    steps: int
    seconds: float
    eval_before: float | None
    eval_after: float | None


@attrs.define
class Trainer:
    """`runner` runs its program once per step on the batch `next_batch()` returns (and on more of
    them when the program's `rg.filter_groups` refills its batch).

    `sampler` (anything with `state_dict`/`load_state_dict`) is checkpointed with the models so a
    resumed run sees exactly the batches the uninterrupted run would have seen. So are the torch
    RNG (dropout, LoRA dropout) and whatever `extra_state()` returns (`load_extra` takes it back).

    `before_step(step)` runs before each step (a learning-rate schedule); `after_step(step,
    metrics)` returns the step's metrics enriched (reward terms, evaluation) before they enter the
    history and the checkpoint. `keep_last` checkpoints are kept.
    """

    runner: Runner
    next_batch: Callable[[], Any]
    sampler: Any = None
    run_dir: Path | None = None
    checkpoint_every: int | None = None
    keep_last: int | None = None
    step: int = 0
    history: list[dict[str, float]] = attrs.field(factory=list)
    before_step: Callable[[int], None] | None = None
    after_step: Callable[[int, dict[str, float]], dict[str, float]] | None = None
    extra_state: Callable[[], dict[str, Any]] | None = None
    load_extra: Callable[[dict[str, Any]], None] | None = None

    def resume(self, path: Path | None = None) -> bool:
        """Load checkpoint `path` (default: the latest of `run_dir`) if there is one; returns whether it did."""
        path = path or (latest_checkpoint(self.run_dir) if self.run_dir else None)
        if path is None:
            return False
        restored = load_checkpoint(path, self.runner)  # every file read and checked before anything changes
        if self.load_extra is not None:
            self.load_extra(restored.get("user", {}))
        self.step = restored["step"]
        self.history = list(restored.get("history", []))
        if self.sampler is not None:
            self.sampler.load_state_dict(restored["sampler"])
        self.runner.carried = {name: torch.as_tensor(value) for name, value in restored.get("carried", {}).items()}
        if restored.get("torch_rng") is not None:
            torch.set_rng_state(restored["torch_rng"])
        self.runner.import_in_flight(restored.get("in_flight"), str(path))  # asynchronous RL: the batches generated ahead
        return True

    def save(self) -> Path:
        assert self.run_dir is not None, "set run_dir to checkpoint"
        extra = {"history": self.history, "sampler": self.sampler.state_dict() if self.sampler is not None else None,
                 "carried": dict(self.runner.carried),  # state.carry values (e.g. an adaptive KL coefficient)
                 "torch_rng": torch.get_rng_state(),
                 "in_flight": self.runner.export_in_flight(),
                 "user": self.extra_state() if self.extra_state is not None else {}}
        path = save_checkpoint(self.run_dir, self.step, self.runner, extra)  # spmd/Ray ranks write their own rows
        if self.keep_last:
            prune_checkpoints(self.run_dir, self.keep_last)
        return path

    def run_step(self) -> dict[str, float]:
        if self.before_step is not None:
            self.before_step(self.step)
        start = time.perf_counter()
        # next_batch is also the prompt source of a refill loop (rg.filter_groups): the sampler,
        # checkpointed with the models, sees every batch drawn, so a resumed run stays exact.
        _, metrics = self.runner.run(self.next_batch(), more_prompts=self.next_batch)
        metrics[STEP_SECONDS] = time.perf_counter() - start
        self.step += 1
        if self.after_step is not None:
            metrics = self.after_step(self.step, metrics)
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
