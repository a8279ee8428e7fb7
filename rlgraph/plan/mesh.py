"""Meshes and placement policies: plain frozen data the `place` pass resolves.

    rg.Mesh.parse("gpu:8")          one node, 8 GPUs
    rg.Mesh.parse("2x8:h100")       2 nodes x 8 H100s
    rg.colocated(fsdp=8, tp=2)      every role time-shares all ranks (hybrid engine)
    rg.split({"policy": 4, "rollout": 4})   disjoint rank sets; `rollout` is the policy's generator
    rg.colocated(tp=8, cpu_offload=True)    training state in host memory (FSDP2's CPUOffloadPolicy)
"""

from __future__ import annotations

import inspect
import numbers
import re
from collections.abc import Mapping, Sequence

import attrs

from rlgraph.errors import ConfigError, did_you_mean
from rlgraph.ir.keyvalue import parse_assignments
from rlgraph.plan.hardware import DEVICE_MEMORY_GIB, HOST_MEMORY_GIB  # one table: the hardware profiles

GiB = 1 << 30


@attrs.frozen
class Mesh:
    """`nodes` x `per_node` devices of one kind; ranks are numbered node-major. `memory_gib`
    overrides the device's memory, `host_memory_gib` the host memory per device (a node holds
    `per_node` times that)."""

    device: str = "cpu"
    nodes: int = 1
    per_node: int = 1
    memory_gib: float | None = None
    host_memory_gib: float | None = None

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.device, str):  # Mesh(8): a count where the device kind goes
            raise ConfigError(f"Mesh: the first argument is the device kind, a string, got {self.device!r}",
                              fix=f"write e.g. rg.Mesh('h100', nodes=1, per_node={self.device if _is_count(self.device) else 8}) "
                                  "or mesh='gpu:8'")
        for name in ("nodes", "per_node"):
            value = getattr(self, name)
            if not _is_count(value):
                raise ConfigError(f"Mesh: {name} must be a whole number >= 1, got {value!r} ({type(value).__name__})",
                                  fix="write e.g. rg.Mesh('h100', nodes=2, per_node=8), numbers not strings")
        if self.nodes < 1 or self.per_node < 1:
            raise ConfigError(f"Mesh: nodes and per_node must be >= 1, got {self.nodes}x{self.per_node}",
                              fix="write e.g. rg.Mesh('h100', nodes=1, per_node=8) or mesh='gpu:8'")
        if self.memory_gib is None and self.device not in DEVICE_MEMORY_GIB:
            raise ConfigError(f"Mesh: unknown device {self.device!r}{did_you_mean(self.device, DEVICE_MEMORY_GIB)}",
                              fix=f"give memory_gib or one of {sorted(DEVICE_MEMORY_GIB)}")
        memory = self.memory_gib
        if memory is not None and (isinstance(memory, bool) or not isinstance(memory, (int, float)) or not 0 < memory < float("inf")):
            raise ConfigError(f"Mesh: memory_gib must be a number of GiB > 0 (memory per device), got {memory!r}",
                              fix="e.g. rg.Mesh('h100', per_node=8, memory_gib=80), or leave it out for the device's own")
        host = self.host_memory_gib
        if host is not None and (isinstance(host, bool) or not isinstance(host, (int, float)) or not host > 0):
            raise ConfigError(f"Mesh: host_memory_gib must be a number of GiB > 0 (host memory per device), got {host!r}",
                              fix="e.g. rg.Mesh('h100', nodes=2, per_node=8, host_memory_gib=256), or leave it out")

    @classmethod
    def parse(cls, text: str) -> Mesh:
        """`gpu:8`, `h100:8`, `2x8:h100`, `cpu:2` (`gpu` means H100)."""
        match = re.fullmatch(r"(?:(\d+)x(\d+):(\w+))|(?:(\w+):(\d+))", text.strip()) if isinstance(text, str) else None
        if not match:  # mesh=8 (a bare count) lands here too: the device kind is not guessed
            raise ConfigError(f"cannot parse mesh {text!r}", fix="write e.g. mesh='gpu:8', 'h100:8', '2x8:h100' or 'cpu:2'")
        if match.group(1):
            nodes, per_node, device = int(match.group(1)), int(match.group(2)), match.group(3)
        else:
            nodes, device, per_node = 1, match.group(4), int(match.group(5))
        return cls("h100" if device == "gpu" else device, nodes, per_node)

    @property
    def size(self) -> int:
        return self.nodes * self.per_node

    @property
    def capacity_bytes(self) -> int:
        return int((self.memory_gib or DEVICE_MEMORY_GIB[self.device]) * GiB)

    @property
    def host_capacity_bytes(self) -> int | None:
        """Host memory of one node (None where unknown, or on a cpu mesh, whose devices are the host)."""
        per_device = self.host_memory_gib or (None if self.device == "cpu" else HOST_MEMORY_GIB.get(self.device))
        return None if per_device is None else int(per_device * self.per_node * GiB)

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def __str__(self) -> str:
        return f"{self.nodes}x{self.per_node} {self.device}"


def _is_count(value: object) -> bool:
    """A whole number that is not a bool (True is an int to Python, never a meant device count)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@attrs.frozen
class TrainLayout:
    """FSDP2 over `fsdp` ranks (data parallel across the rest), optional activation checkpointing.

    `cpu_offload`: FSDP2's `CPUOffloadPolicy`. The sharded parameters, their gradients and the
    optimizer state live in host memory for the whole run; for each unit's all-gather (forward and
    backward) FSDP2 copies its shard to the device, the device holds the unsharded unit while it
    computes, the backward copies each sharded gradient back to the host, and the optimizer step
    runs on the CPU.

    `grad_sync_last`: with several micro-batches per optimizer step, gradients accumulate unsharded
    on every rank and are reduce-scattered once, after the last micro-batch (FSDP2's
    `set_requires_gradient_sync`), instead of once per micro-batch. It costs one unsharded gradient
    per rank, so `place` turns it on only where the memory model says that still fits.
    """

    fsdp: int
    dp: int = 1
    checkpointing: bool = True
    cpu_offload: bool = False
    grad_sync_last: bool = False

    def __str__(self) -> str:
        return (f"fsdp2 shard={self.fsdp}" + (f" replicate={self.dp}" if self.dp > 1 else "")
                + (" ckpt" if self.checkpointing else "") + (" cpu_offload" if self.cpu_offload else "")
                + (" grad-sync=last-micro" if self.grad_sync_last else ""))


@attrs.frozen
class GenerateLayout:
    """Generation engine: `tp`-way tensor parallel replicas, `dp` of them, run by `engine`
    ("native" or "vllm"; None until `place` sets it from `CompileOptions.engine`)."""

    tp: int = 1
    dp: int = 1
    engine: str | None = None

    def __str__(self) -> str:
        return (f"{self.engine} " if self.engine else "") + f"tp={self.tp} dp={self.dp}"


@attrs.frozen
class Group:
    """A worker group: a role's ranks and its layouts per phase."""

    name: str
    ranks: tuple[int, ...]
    train: TrainLayout | None = None
    generate: GenerateLayout | None = None
    infer_dp: int | None = None  # forward-only data parallel degree

    @property
    def dp(self) -> int:
        """How many ways a batch is split across this group."""
        if self.train is not None:
            return self.train.fsdp * self.train.dp
        if self.generate is not None:
            return self.generate.dp
        return self.infer_dp or len(self.ranks)

    @property
    def data_parallel(self) -> int:
        """How many data-parallel pieces a batch is cut into in the group's busiest phase (training's
        shards or generation's replicas): each rank takes whole rows, so a batch must divide by it."""
        return max(self.dp, self.generate.dp if self.generate else 1)

    def ranks_text(self) -> str:
        ranks = self.ranks
        if ranks and ranks == tuple(range(ranks[0], ranks[-1] + 1)):
            return f"ranks {ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else f"rank {ranks[0]}"
        return "ranks " + ",".join(map(str, ranks))


@attrs.frozen
class Colocated:
    """Every role on every rank, time-shared (verl's hybrid engine); `offload` moves the generating
    trainer's optimizer state off the device between phases; `cpu_offload` keeps every training
    role's state in host memory throughout (`TrainLayout.cpu_offload`); `grad_sync` when FSDP2
    reduce-scatters the gradients of an accumulation: "each" micro-batch, once after the "last"
    (`TrainLayout.grad_sync_last`: costs an unsharded gradient per rank), or "auto" (the last where
    that fits in memory the plan reserves anyway)."""

    fsdp: int | None = None
    tp: int = 1
    offload: bool = True
    checkpointing: bool = True
    cpu_offload: bool = False
    grad_sync: str = "auto"


@attrs.frozen
class Split:
    """Disjoint rank sets per group: `{"policy": 4, "rollout": 4}`; a group may name another to share it.
    `cpu_offload`: every training group keeps its state in host memory (`TrainLayout.cpu_offload`);
    `grad_sync` as in `Colocated`."""

    groups: Mapping[str, int | Sequence[int] | str]
    tp: int = 1
    checkpointing: bool = True
    cpu_offload: bool = False
    grad_sync: str = "auto"


@attrs.frozen
class Explicit:
    """Every group spelled out."""

    groups: tuple[Group, ...]


Placement = Colocated | Split | Explicit


def colocated(*, fsdp: int | None = None, tp: int = 1, offload: bool = True, checkpointing: bool = True,
              cpu_offload: bool = False, grad_sync: str = "auto") -> Colocated:
    return Colocated(fsdp, tp, offload, checkpointing, cpu_offload, grad_sync)


def split(groups: Mapping[str, int | Sequence[int] | str], *, tp: int = 1, checkpointing: bool = True,
          cpu_offload: bool = False, grad_sync: str = "auto") -> Split:
    return Split(dict(groups), tp, checkpointing, cpu_offload, grad_sync)


def explicit(*groups: Group) -> Explicit:
    return Explicit(tuple(groups))


PLACEMENT_FORMS = "auto, colocated[:fsdp=8,tp=2,offload=False,cpu_offload=True] or split:policy=4,rollout=4[,ref=policy][,tp=2]"


def parse_placement(text: str, where: str = "--placement") -> Placement | str:
    """A placement from its text form; `where` (the flag or config key) names it in errors.

        parse_placement("colocated:fsdp=8,tp=2")            -> colocated(fsdp=8, tp=2)
        parse_placement("split:policy=4,rollout=4,tp=2")    -> split({"policy": 4, "rollout": 4}, tp=2)
        parse_placement("auto")                             -> "auto" (the compiler searches)
    """
    if text == "auto":
        return "auto"
    kind, _, rest = text.partition(":")
    fields = parse_assignments([item for item in rest.split(",") if item], f"{where} {kind}:", "tp=2")
    if kind == "colocated":
        known = list(inspect.signature(colocated).parameters)
        for key in fields:
            if key not in known:
                raise ConfigError(f"{where} {text!r}: unknown option {key!r}{did_you_mean(key, known)} "
                                  f"(colocated takes {', '.join(known)})", fix=f"use {PLACEMENT_FORMS}")
        return colocated(**fields)
    if kind == "split":
        options = {key: fields.pop(key) for key in ("tp", "checkpointing", "cpu_offload", "grad_sync") if key in fields}
        return split(fields, **options)  # every other key names a group
    raise ConfigError(f"{where} {text!r}: unknown placement {kind!r}{did_you_mean(kind, ['auto', 'colocated', 'split'])}",
                      fix=f"use {PLACEMENT_FORMS}")
