"""Batches in flight under asynchronous RL (`staleness=k`): what the plan runner keeps between calls.

With k >= 1 the runner issues batch i+k's rollout lane while batch i's train lane trains, so up
to k+1 batches live on the workers at once. Each gets a *slot* (0..k, reused round-robin): the
workers hold the lowered program once per slot with every node renamed `name@slot`
(`slot_program`), so two batches' values never share a name in a worker's store, and the
transports need no notion of batches at all. On the controller each batch keeps its own values
(`InFlight.env`), its prompts and the version of the generating role it was issued with.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch.fx as fx

from rlgraph.ir.program import Program, copy_program


def slot_name(name: str, slot: int | None) -> str:
    """A node's name in a worker's store: itself when synchronous (slot None), `name@slot` otherwise."""
    return name if slot is None else f"{name}@{slot}"


def slot_program(program: Program, slot: int) -> Program:
    """A copy of `program` whose nodes are named `name@slot` (inputs and loss closures keep their
    targets and contents: only the store keys the workers read and write change)."""
    copy, _ = copy_program(program)
    for node in copy.graph.nodes:
        node.name = slot_name(node.name, slot)
    return copy


@attrs.define
class InFlight:
    """One batch whose rollout lane was issued: its slot, its controller values, the version of the
    generating role it was generated with, and its sequence number (0 for the run's first batch)."""

    slot: int
    env: dict[fx.Node, Any]
    version: int
    batch: int
