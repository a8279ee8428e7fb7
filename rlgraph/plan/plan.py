"""The lowered plan: plain, serializable, diffable data.

A plan is the ordered list of steps one iteration executes: stages (a group of ranks running
program nodes in one phase), transfers (an explicit collective moving one value between
layouts, with its bytes), weight syncs (train layout -> generation layout, bucketed) and
offload/onload points; and the loops over some of those steps (`rg.filter_groups` re-running
generation and scoring on fresh prompts until the batch is full). Plus the groups (ranks and layouts), the concrete sizes the byte counts
were computed for, and the peak memory per rank of every group and phase.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from typing import Any

import attrs

from rlgraph.plan.mesh import GenerateLayout, Group, Mesh, TrainLayout


def _mib(nbytes: float) -> str:
    if nbytes >= 1 << 30:
        return f"{nbytes / (1 << 30):.2f} GiB"
    if nbytes >= 1 << 20:
        return f"{nbytes / (1 << 20):.2f} MiB"
    if nbytes >= 1 << 10:
        return f"{nbytes / (1 << 10):.1f} KiB"
    return f"{int(nbytes)} B"


@attrs.frozen
class Stage:
    index: int
    group: str
    phase: str  # generate | infer | train | reward | math | controller | filter | fields (reads only: no work)
    nodes: tuple[str, ...]
    ops: tuple[str, ...]
    detail: str = ""
    flops: float = 0.0
    kernels: tuple[str, ...] = ()

    def text(self) -> str:
        line = f"[{self.index}] {self.phase:<10} @{self.group:<9} {'  '.join(self.ops)}"
        extra = [self.detail] if self.detail else []
        if self.kernels:
            extra.append("kernels: " + ", ".join(self.kernels))
        if self.flops:
            extra.append(f"~{self.flops:.3g} FLOP")
        return line + ("\n        " + " | ".join(extra) if extra else "")


@attrs.frozen
class Transfer:
    index: int
    kind: str  # scatter | gather | broadcast | all_gather | send_recv
    value: str
    spec: str
    src: str
    dst: str
    bytes: int

    def text(self) -> str:
        return f"[{self.index}] {self.kind:<10} {self.value}:{self.spec}  {self.src} -> {self.dst}  {_mib(self.bytes)}"


@attrs.frozen
class SyncWeights:
    index: int
    role: str
    version: str
    src: str
    dst: str
    bytes: int
    buckets: int

    def text(self) -> str:
        return (f"[{self.index}] sync_weights {self.version}  {self.src} -> {self.dst}  "
                f"{_mib(self.bytes)} in {self.buckets} bucket(s)")


@attrs.frozen
class Offload:
    index: int
    group: str
    what: str
    direction: str  # offload | onload
    bytes: int

    def text(self) -> str:
        return f"[{self.index}] {self.direction:<10} @{self.group:<9} {self.what} {_mib(self.bytes)}"


Step = Stage | Transfer | SyncWeights | Offload
_STEP_TYPES = {cls.__name__: cls for cls in (Stage, Transfer, SyncWeights, Offload)}


def _ranges(indices: tuple[int, ...]) -> str:
    """(1, 2, 3, 5) -> "1-3, 5"."""
    parts: list[list[int]] = []
    for index in indices:
        if parts and index == parts[-1][1] + 1:
            parts[-1][1] = index
        else:
            parts.append([index, index])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in parts)


@attrs.frozen
class Loop:
    """A refill loop (`rg.filter_groups`): `steps` re-run on a fresh batch of prompts (input
    `prompts`) until `filter_step` has kept B groups or `max_rounds` rounds have run."""

    steps: tuple[int, ...]
    filter_step: int
    prompts: str
    max_rounds: int

    def text(self, groups: int | str = "B") -> str:
        return (f"loop: steps {_ranges(self.steps)} repeat on fresh {self.prompts} until {groups} groups are kept "
                f"(filter_groups at step {self.filter_step}, <= {self.max_rounds} rounds; bytes and FLOP above are per round)")


@attrs.frozen
class Plan:
    algorithm: str
    mesh: Mesh
    placement: str
    groups: tuple[Group, ...]
    sizes: Mapping[str, int]
    steps: tuple[Step, ...]
    memory: Mapping[str, Mapping[str, Mapping[str, int]]]  # group -> phase -> {part: bytes, "total": ..}
    notes: tuple[str, ...] = ()
    loops: tuple[Loop, ...] = ()
    host_memory: Mapping[str, Mapping[str, int]] = attrs.field(factory=dict)  # group -> {part: bytes, "total": ..} per rank

    # -- reading ---------------------------------------------------------------------------
    def group(self, name: str) -> Group:
        return next(group for group in self.groups if group.name == name)

    def transfers(self) -> list[Transfer]:
        return [step for step in self.steps if isinstance(step, Transfer)]

    def stages(self) -> list[Stage]:
        return [step for step in self.steps if isinstance(step, Stage)]

    def peak_memory(self, group: str) -> int:
        return max(parts["total"] for parts in self.memory[group].values())

    def as_text(self) -> str:
        sizes = " ".join(f"{k}={v}" for k, v in self.sizes.items())
        lines = [f"plan {self.algorithm}  on {self.mesh}  placement {self.placement}  ({sizes})", "groups:"]
        for group in self.groups:
            layouts = [f"train: {group.train}" if group.train else "", f"generate: {group.generate}" if group.generate else ""]
            layouts = "; ".join(text for text in layouts if text) or f"infer dp={group.dp}"
            peak = f"peak {_mib(self.peak_memory(group.name))}/rank" if group.name in self.memory else ""
            lines.append(f"  {group.name:<9} {group.ranks_text():<12} {layouts:<40} {peak}")
        lines.append("steps:")
        lines.extend("  " + step.text().replace("\n", "\n  ") for step in self.steps)
        lines.extend(loop.text(f"B={self.sizes['B']}" if "B" in self.sizes else "B") for loop in self.loops)
        lines.append("memory per rank (peak over phases):")
        for name, phases in self.memory.items():
            for phase, parts in phases.items():
                shown = ", ".join(f"{k} {_mib(v)}" for k, v in parts.items() if v and k != "total")
                lines.append(f"  {name:<9} {phase:<9} {_mib(parts['total']):>11}  ({shown})")
        lines.extend(self._host_memory_lines())
        moved = sum(step.bytes for step in self.steps if isinstance(step, (Transfer, SyncWeights)))
        lines.append(f"total moved per iteration: {_mib(moved)}")
        lines.append(self.cost_analysis().text())
        lines.extend(f"note: {note}" for note in self.notes)
        return "\n".join(lines)

    def _host_memory_lines(self) -> list[str]:
        """What each rank keeps in host memory (offloaded training state), against a node's host memory."""
        if not self.host_memory:
            return []
        capacity = self.mesh.host_capacity_bytes
        has = f"a node has {_mib(capacity)} for {self.mesh.per_node} ranks" if capacity else "host capacity unknown"
        lines = [f"host memory per rank ({has}):"]
        for name, parts in self.host_memory.items():
            why = "cpu_offload" if self.group(name).train and self.group(name).train.cpu_offload else "offload"
            shown = ", ".join(f"{k} {_mib(v)}" for k, v in parts.items() if v and k != "total")
            lines.append(f"  {name:<9} {why:<11} {_mib(parts['total']):>11}  ({shown})")
        return lines

    def __str__(self) -> str:
        return self.as_text()

    def cost_analysis(self, hardware=None):
        """Estimated seconds per step, per phase and in total (`rlgraph.plan.cost.CostAnalysis`) on
        `hardware` (a `HardwareProfile`; default: the mesh's device)."""
        from rlgraph.plan.cost import plan_cost

        return plan_cost(self, hardware)

    def memory_analysis(self) -> dict[str, dict[str, dict[str, int]]]:
        return {group: {phase: dict(parts) for phase, parts in phases.items()} for group, phases in self.memory.items()}

    # -- serialisation ---------------------------------------------------------------------
    def to_json(self) -> str:
        def encode(value: Any) -> Any:
            if attrs.has(type(value)):
                fields = {f.name: encode(getattr(value, f.name)) for f in attrs.fields(type(value))}
                return {"__type__": type(value).__name__, **fields}
            if isinstance(value, (list, tuple)):
                return [encode(item) for item in value]
            if isinstance(value, Mapping):
                return {key: encode(item) for key, item in value.items()}
            return value

        return json.dumps(encode(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        types = {**_STEP_TYPES, "Plan": Plan, "Loop": Loop, "Mesh": Mesh, "Group": Group, "TrainLayout": TrainLayout,
                 "GenerateLayout": GenerateLayout}

        def decode(value: Any) -> Any:
            if isinstance(value, dict) and "__type__" in value:
                kind = types[value["__type__"]]
                fields = {f.name: f for f in attrs.fields(kind)}
                args = {}
                for key, item in value.items():
                    if key == "__type__":
                        continue
                    item = decode(item)
                    args[key] = tuple(item) if isinstance(item, list) and "tuple" in str(fields[key].type) else item
                return kind(**args)
            if isinstance(value, list):
                return [decode(item) for item in value]
            if isinstance(value, dict):
                return {key: decode(item) for key, item in value.items()}
            return value

        return decode(json.loads(text))

    def diff(self, other: Plan) -> str:
        """A unified diff of the two plans' text."""
        return "\n".join(difflib.unified_diff(self.as_text().splitlines(), other.as_text().splitlines(),
                                              "a", "b", lineterm=""))

    def to_dot(self) -> str:
        from rlgraph.plan.dot import plan_to_dot

        return plan_to_dot(self)
