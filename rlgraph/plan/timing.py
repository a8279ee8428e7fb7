"""Where a step's time goes, under one set of names: each plan step's kind, and the metric keys.

A plan step's kind is what the plan prints it as: a stage's phase (generate, infer, train, reward,
math, controller, filter, fields), `transfer` for the collectives, `sync_weights`, and `offload` (an
offload or onload). `seconds_by_kind` sums a runner's seconds per step index into those kinds;
`rlgraph train` logs them as `time/<kind>_s` (`stage_metric`) beside the step's wall time
(`STEP_SECONDS`) and its decode compiles (`COMPILE_SECONDS`), and `rlgraph bench` reports the same
kinds per measured step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from rlgraph.plan.plan import Offload, Stage, Step, SyncWeights, Transfer

STEP_SECONDS = "time/step_s"  # a training step's wall time, compiles included
COMPILE_SECONDS = "time/compile_s"  # the decode compiles inside it (generation.compile): reported apart

_KINDS = {Transfer: "transfer", SyncWeights: "sync_weights", Offload: "offload"}


def step_kind(step: Step) -> str:
    """`[3] generate @policy ...` -> "generate"; a transfer -> "transfer"; a weight sync -> "sync_weights"."""
    return step.phase if isinstance(step, Stage) else _KINDS[type(step)]


def stage_metric(kind: str) -> str:
    """The metrics key of a kind's seconds: "generate" -> "time/generate_s"."""
    return f"time/{kind}_s"


def seconds_by_kind(steps: Iterable[Step], seconds: Mapping[int, float]) -> dict[str, float]:
    """`seconds` (plan step index -> seconds) summed by the kinds of `steps` (0.0 for a step not in it)."""
    totals: dict[str, float] = {}
    for step in steps:
        kind = step_kind(step)
        totals[kind] = totals.get(kind, 0.0) + seconds.get(step.index, 0.0)
    return totals
