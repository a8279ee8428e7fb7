"""Batches in flight under asynchronous RL (`staleness=k`): what the plan runner keeps between calls.

With k >= 1 the runner issues batch i+k's rollout lane while batch i's train lane trains, so up
to k+1 batches live on the workers at once. Each gets a *slot* (0..k, reused round-robin): the
workers hold the lowered program once per slot with every node renamed `name@slot`
(`slot_program`), so two batches' values never share a name in a worker's store, and the
transports need no notion of batches at all. On the controller each batch keeps its own values
(`InFlight.env`), its prompts and the version of the generating role it was issued with.

A checkpoint holds the batches in flight (`encode`/`decode`: plain data, as checkpoints are read
without unpickling objects): the values their train lanes will read, on the controller and on each
rank that holds a piece of them, so a resumed run trains exactly the batches the uninterrupted run
would have trained.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.fx as fx

from rlgraph.backends.protocols import EnvRef, ModelRef, RewardRef
from rlgraph.batches import Prompts, Rollouts
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


# -- checkpoints: values of batches in flight as plain data (tensors, numbers, strings, containers) --
# A checkpoint is loaded with `torch.load(weights_only=True)`, which never unpickles objects: the few
# record types a batch holds are written as tagged dicts and rebuilt from their fields.
_RECORDS = {cls.__name__: cls for cls in (Prompts, Rollouts, ModelRef, RewardRef, EnvRef)}


def encode(value: Any) -> Any:
    """`value` (a batch record, a tensor, a container of them) as plain data."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if type(value).__name__ in _RECORDS and isinstance(value, _RECORDS[type(value).__name__]):
        return {"__record__": type(value).__name__, **{f.name: encode(getattr(value, f.name)) for f in attrs.fields(type(value))}}
    if isinstance(value, tuple):
        return {"__tuple__": [encode(item) for item in value]}
    if isinstance(value, list):
        return [encode(item) for item in value]
    if isinstance(value, dict):
        return {"__dict__": [[key, encode(item)] for key, item in value.items()]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"a value in flight of type {type(value).__name__} cannot be checkpointed")  # a new record type


def decode(data: Any) -> Any:
    """The value `encode` wrote."""
    if isinstance(data, list):
        return [decode(item) for item in data]
    if not isinstance(data, dict):
        return data
    if "__tuple__" in data:
        return tuple(decode(item) for item in data["__tuple__"])
    if "__dict__" in data:
        return {key: decode(item) for key, item in data["__dict__"]}
    fields = {key: decode(item) for key, item in data.items() if key != "__record__"}
    return _RECORDS[data["__record__"]](**fields)
