"""Meshes and placement policies: plain frozen data the `place` pass resolves.

    rg.Mesh.parse("gpu:8")          one node, 8 GPUs
    rg.Mesh.parse("2x8:h100")       2 nodes x 8 H100s
    rg.colocated(fsdp=8, tp=2)      every role time-shares all ranks (hybrid engine)
    rg.split({"policy": 4, "rollout": 4})   disjoint rank sets; `rollout` is the policy's generator
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import attrs

from rlgraph.ir.errors import ConfigError, did_you_mean
from rlgraph.plan.hardware import DEVICE_MEMORY_GIB  # one table: the hardware profiles

GiB = 1 << 30


@attrs.frozen
class Mesh:
    """`nodes` x `per_node` devices of one kind; ranks are numbered node-major."""

    device: str = "cpu"
    nodes: int = 1
    per_node: int = 1
    memory_gib: float | None = None

    def __attrs_post_init__(self) -> None:
        if self.nodes < 1 or self.per_node < 1:
            raise ConfigError(f"Mesh: nodes and per_node must be >= 1, got {self.nodes}x{self.per_node}",
                              fix="write e.g. rg.Mesh('h100', nodes=1, per_node=8) or mesh='gpu:8'")
        if self.memory_gib is None and self.device not in DEVICE_MEMORY_GIB:
            raise ConfigError(f"Mesh: unknown device {self.device!r}{did_you_mean(self.device, DEVICE_MEMORY_GIB)}",
                              fix=f"give memory_gib or one of {sorted(DEVICE_MEMORY_GIB)}")

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

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def __str__(self) -> str:
        return f"{self.nodes}x{self.per_node} {self.device}"


@attrs.frozen
class TrainLayout:
    """FSDP2 over `fsdp` ranks (data parallel across the rest), optional activation checkpointing."""

    fsdp: int
    dp: int = 1
    checkpointing: bool = True

    def __str__(self) -> str:
        return f"fsdp2 shard={self.fsdp}" + (f" replicate={self.dp}" if self.dp > 1 else "") + (" ckpt" if self.checkpointing else "")


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

    def ranks_text(self) -> str:
        ranks = self.ranks
        if ranks and ranks == tuple(range(ranks[0], ranks[-1] + 1)):
            return f"ranks {ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else f"rank {ranks[0]}"
        return "ranks " + ",".join(map(str, ranks))


@attrs.frozen
class Colocated:
    """Every role on every rank, time-shared (verl's hybrid engine); offload between phases."""

    fsdp: int | None = None
    tp: int = 1
    offload: bool = True
    checkpointing: bool = True


@attrs.frozen
class Split:
    """Disjoint rank sets per group: `{"policy": 4, "rollout": 4}`; a group may name another to share it."""

    groups: Mapping[str, int | Sequence[int] | str]
    tp: int = 1
    checkpointing: bool = True


@attrs.frozen
class Explicit:
    """Every group spelled out."""

    groups: tuple[Group, ...]


Placement = Colocated | Split | Explicit


def colocated(*, fsdp: int | None = None, tp: int = 1, offload: bool = True, checkpointing: bool = True) -> Colocated:
    return Colocated(fsdp, tp, offload, checkpointing)


def split(groups: Mapping[str, int | Sequence[int] | str], *, tp: int = 1, checkpointing: bool = True) -> Split:
    return Split(dict(groups), tp, checkpointing)


def explicit(*groups: Group) -> Explicit:
    return Explicit(tuple(groups))
