"""Counterexamples a person can read and paste: the shrunk batch as code, and what went wrong.

A checker that finds a failing batch raises `PropertyFailure`. Hypothesis has shrunk the batch by
then (fewest groups, shortest responses, simplest numbers), so the message is short:

    micro-batch invariance fails for broken_loss: out: sum over micro-batches 2.0 != expected 1.0
    paste into a test to reproduce:

        import torch
        from rlgraph.testing import RolloutBatch, microbatch_losses
        batch = RolloutBatch.of(
            group=[0, 0],
            mask=[[True], [True]],
            advantages=[[1.0], [1.0]],
            dtype=torch.float32,
        )
        micro_batches = [[0], [1]]
        ...

Only the fields the function read are printed (plus `group` and `mask`, which shape the batch).
"""

from __future__ import annotations

from typing import Any

import attrs

from rlgraph.testing.batch import FIELDS, RolloutBatch


@attrs.frozen
class Counterexample:
    """The minimal failing input of a property, as data and as code."""

    prop: str                   # "micro-batch invariance"
    function: str               # the checked function's qualified name
    batch: RolloutBatch | None  # the shrunk batch (None for properties of plans or programs)
    details: dict[str, Any]     # the rest of the input (micro-batches, permutation, padding) and the numbers
    message: str                # what went wrong, in one line
    fields: tuple[str, ...] = FIELDS  # the batch fields the function read
    source: str | None = None   # code of a generated program, when the input is one

    def snippet(self) -> str:
        """Python that rebuilds the failing input and repeats the check."""
        lines = ["import torch", "from rlgraph import functional as F",
                 "from rlgraph.testing import RolloutBatch, microbatch_losses", ""]
        if self.source:
            lines += [self.source, ""]
        if self.batch is not None:
            lines.append(self.batch.to_source("batch", self.fields))
        lines += _detail_lines(self.prop, self.function, self.details, self.fields)
        return "\n".join(lines)

    def __str__(self) -> str:
        body = "\n".join("    " + line if line else "" for line in self.snippet().splitlines())
        return f"{self.prop} fails for {self.function}: {self.message}\npaste into a test to reproduce:\n\n{body}\n"


def _detail_lines(prop: str, function: str, details: dict[str, Any], fields: tuple[str, ...]) -> list[str]:
    fn = function.split(".")[-1] if function.isidentifier() or "." in function else "fn"
    fn = fn if fn.isidentifier() else "fn"  # lambdas: name the placeholder
    lines: list[str] = []
    if "raised" in details:
        return [f"{fn}(batch)  # raised {details['raised']}"]
    if prop == "micro-batch invariance":
        lines += [f"micro_batches = {details['micro_batches']!r}",
                  f"full = {fn}(batch)  # {details.get('full')}",
                  f"parts = microbatch_losses({fn}, batch, micro_batches)  # summed: {details.get('summed')}",
                  "# expected: sum of parts == full (losses, metrics and gradients)"]
    elif prop == "padding invariance":
        padded = details["padded"]
        lines += ["", padded.to_source("padded", fields),
                  f"# expected: {fn}(batch) == {fn}(padded) at unmasked positions "
                  f"({details['extra_columns']} extra padding column(s))"]
    elif prop == "group-permutation equivariance":
        lines += [f"rows, labels = {details['rows']!r}, {details['labels']!r}",
                  "permuted = batch.select(rows).relabel(labels)",
                  f"# expected: {fn}(permuted) == {fn}(batch)[rows] for per-row outputs"]
    elif prop == "finiteness":
        lines += [f"out = {fn}(batch)",
                  f"# expected: every value finite; {details['output']}{details['index'] or ''} is not"]
    elif prop == "singleton groups give 0":
        lines += [f"out = {fn}(batch)  # every row is its own group",
                  f"# expected: {details['output']} is 0 on every row"]
    else:
        lines += [f"# {key} = {value!r}" for key, value in details.items()]
    return lines


class PropertyFailure(AssertionError):
    """A property of a dataflow does not hold; `.counterexample` is the minimal failing input."""

    def __init__(self, counterexample: Counterexample):
        super().__init__(str(counterexample))
        self.counterexample = counterexample


class _Reading:
    """A read-only view of a batch that records which fields the function under test reads."""

    def __init__(self, batch: RolloutBatch):
        object.__setattr__(self, "_batch", batch)
        object.__setattr__(self, "fields_read", set())

    def __getattr__(self, name: str) -> Any:
        if name in FIELDS:
            self.fields_read.add(name)
        return getattr(self._batch, name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"RolloutBatch is read-only (tried to set {name!r})")


def fail(prop: str, function: str, message: str, *, batch: RolloutBatch | None = None,
         fields: tuple[str, ...] = (), **details: Any) -> None:
    """Raise `PropertyFailure` for property `prop` of `function` (the checkers' one way to fail)."""
    raise PropertyFailure(Counterexample(prop, function, batch, details, message, fields))


def reading(batch: RolloutBatch) -> Any:
    return _Reading(batch)
