"""Estimated seconds of every plan step, from the plan alone and a hardware profile.

    cost = plan_cost(plan)          # the profile of plan.mesh.device
    cost.total, cost.phases         # 41.2, {"generate": 30.1, "train": 8.3, ...}
    print(cost.text())

Steps run one after another, so the step time is the sum over steps. Per kind of step:

- **generate**: prefill is compute-bound, `flops * P/(P+T) / (ranks * peak * prefill_efficiency)`;
  each of the `T` decode steps reads, on every rank, its share of the weights and of the KV cache
  (the plan's generate memory: params/tp and the cache, on average half-grown past the prompt) at
  `memory_bandwidth * decode_efficiency`, or is compute-bound if that is slower. Tensor
  parallelism splits the bytes but adds two all-reduces per layer per token; that is folded into
  `TP_DECODE_SCALING` (each doubling of tp keeps this fraction of the ideal speed-up).
- **train / infer**: `flops / (ranks * peak * train_efficiency)` (4/3 of it for a trainer with
  activation checkpointing, which recomputes the forward), overlapped with FSDP's traffic
  (all-gather forward, all-gather backward, reduce-scatter gradients of the full parameters, per
  micro-batch, the reduce-scatter once per optimizer step under `grad_sync_last`; `(s-1)/s` of it
  per rank over the link the shard group crosses; with replicas, a ring all-reduce of the gradient
  shards per optimizer step); the slower wins.
- **collectives**: `latency + bytes * factor / (link bandwidth * link_efficiency)`; the link is
  NVLink when both ends lie in one node (`Mesh.node_of`), the network otherwise, the host link to
  and from the controller. `factor` is the algorithm's: 1 for a point-to-point copy, scatter or
  gather, `(n-1)/n` for an all-gather, `2(n-1)/n` for a ring all-reduce.
- **sync_weights**: the parameter bytes, all-gathered over the trainer's shards when the
  generator shares its ranks, else broadcast from the trainer to the generator's ranks.
- **offload / onload**: the bytes per rank over the host link (PCIe).
- **reward / controller / math / fields**: the profile's fixed per-stage overhead (the math runs
  on tensors of a few KiB).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

import attrs

from rlgraph.plan.hardware import HardwareProfile, profile as hardware_profile
from rlgraph.plan.mesh import Mesh

TP_DECODE_SCALING = 0.85  # vLLM decode: tp=2 ~1.7x, tp=4 ~2.9x, tp=8 ~4.9x the single-GPU token rate
PHASES = ("generate", "infer", "train", "sync_weights", "transfer", "offload", "other")
_MICRO = re.compile(r"(\d+) epoch\(s\) x (\d+) minibatch\(es\) x (\d+) micro-batch")


@attrs.frozen
class StepCost:
    index: int
    phase: str  # one of PHASES
    seconds: float
    why: str  # what bounds it: "compute", "weights+KV reads", "NVLink", ...


@attrs.frozen
class CostAnalysis:
    """Estimated seconds per step, per phase and in total, for one device profile."""

    device: str
    steps: tuple[StepCost, ...]
    overlap: object = None  # the plan's `Overlap` (staleness >= 1), whose lanes may run at once
    busiest_rank: float = 0.0  # seconds of work (stages, offloads) of the rank that has the most, both lanes

    @property
    def total(self) -> float:
        """The synchronous step time: every step after the other."""
        return sum(step.seconds for step in self.steps)

    def lane_seconds(self, overlap) -> dict[str, float]:
        """Seconds of the rollout lane's steps and of the train lane's."""
        seconds = {step.index: step.seconds for step in self.steps}
        return {"rollout": sum(seconds[i] for i in overlap.rollout), "train": sum(seconds[i] for i in overlap.train)}

    @property
    def step_seconds(self) -> float:
        """The time per iteration in steady state: when generation and training run on disjoint ranks
        the slower lane sets the pace (the other runs meanwhile), or a rank both lanes work on, which
        does their work there one after the other; otherwise the sum of every step."""
        if self.overlap is None or not self.overlap.overlapped:
            return self.total
        return max(*self.lane_seconds(self.overlap).values(), self.busiest_rank)

    @property
    def phases(self) -> dict[str, float]:
        out = {phase: 0.0 for phase in PHASES}
        for step in self.steps:
            out[step.phase] += step.seconds
        return {phase: seconds for phase, seconds in out.items() if seconds}

    def dominant(self) -> str:
        phases = self.phases
        return max(phases, key=phases.get) if phases else "other"

    def phases_text(self) -> str:
        """`generate 12.3 s (71%), train 4.1 s (24%), ...`, largest first."""
        total = self.total or 1.0
        ordered = sorted(self.phases.items(), key=lambda item: -item[1])
        return ", ".join(f"{phase} {format_seconds(seconds)} ({100 * seconds / total:.0f}%)" for phase, seconds in ordered)

    def text(self) -> str:
        return f"estimated step time on {self.device}: {format_seconds(self.total)}  ({self.phases_text()})"

    def as_dict(self) -> dict:
        return {"device": self.device, "total": self.total, "phases": self.phases,
                "steps": {step.index: {"phase": step.phase, "seconds": step.seconds, "why": step.why} for step in self.steps}}


def format_seconds(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.0f} us"


def plan_cost(plan, hardware: HardwareProfile | None = None) -> CostAnalysis:
    """The estimated seconds of every step of `plan` on `hardware` (default: the mesh's device)."""
    hw = hardware or hardware_profile(plan.mesh.device)
    groups = {group.name: group for group in plan.groups}
    steps = []
    for step in plan.steps:
        kind = type(step).__name__
        if kind == "Stage":
            phase, seconds, why = _stage(step, plan, groups, hw)
        elif kind == "Transfer":
            phase = "transfer"
            seconds, why = _transfer(step.kind, step.bytes, _ranks(groups, step.src), _ranks(groups, step.dst), plan.mesh, hw)
        elif kind == "SyncWeights":
            phase, (seconds, why) = "sync_weights", _sync(step, groups, plan.mesh, hw)
        else:  # Offload: per-rank bytes, every rank over its own host link
            phase, seconds, why = "offload", hw.latency_s + step.bytes / (hw.host_bandwidth * hw.link_efficiency), "host link"
        steps.append(StepCost(step.index, phase, seconds, why))
    busy: dict[int, float] = {}
    for cost, step in zip(steps, plan.steps):
        group = getattr(step, "group", None)
        if group in groups and cost.phase not in ("transfer", "sync_weights") and getattr(step, "phase", "") != "fields":
            for rank in groups[group].ranks:
                busy[rank] = busy.get(rank, 0.0) + cost.seconds
    return CostAnalysis(plan.mesh.device, tuple(steps), getattr(plan, "overlap", None), max(busy.values(), default=0.0))


def _ranks(groups: Mapping, name: str) -> tuple[int, ...] | None:
    """A group's ranks; None for the controller (the driver process, on host memory of node 0)."""
    return groups[name].ranks if name in groups else None


def link(mesh: Mesh, ranks: tuple[int, ...] | None, other: tuple[int, ...] | None, hw: HardwareProfile) -> tuple[float, str]:
    """(bandwidth, name) of the slowest link between the two rank sets (None = the controller)."""
    if ranks is None or other is None:
        spans = {mesh.node_of(rank) for rank in (ranks or other or (0,))}
        return (hw.inter_node_bandwidth, "network") if len(spans) > 1 else (hw.host_bandwidth, "host link")
    nodes = {mesh.node_of(rank) for rank in (*ranks, *other)}
    if len(nodes) > 1:
        return hw.inter_node_bandwidth, "network"
    return hw.intra_node_bandwidth, "NVLink" if hw.name != "cpu" else "memory"


def collective_seconds(kind: str, nbytes: float, n: int, bandwidth: float, hw: HardwareProfile) -> float:
    """`latency + bytes * algorithm factor / effective bandwidth`; `n` ranks take part."""
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n}.get(kind, 1.0)
    return hw.latency_s + nbytes * factor / (bandwidth * hw.link_efficiency)


def _transfer(kind: str, nbytes: int, src, dst, mesh: Mesh, hw: HardwareProfile) -> tuple[float, str]:
    bandwidth, name = link(mesh, src, dst, hw)
    n = len(src or dst or (0,))
    return collective_seconds(kind, nbytes, n, bandwidth, hw), name


def _sync(step, groups: Mapping, mesh: Mesh, hw: HardwareProfile) -> tuple[float, str]:
    src, dst = groups[step.src.split("[")[0]], groups[step.dst.split("[")[0]]
    if src.ranks == dst.ranks:  # colocated: every rank gathers the shards it lacks from its shard group
        shards = src.train.fsdp if src.train else len(src.ranks)
        shard_ranks = src.ranks[:shards]
        bandwidth, name = link(mesh, shard_ranks, shard_ranks, hw)
        return collective_seconds("all_gather", step.bytes, shards, bandwidth, hw) * (1 if shards > 1 else 0), name
    bandwidth, name = link(mesh, src.ranks, dst.ranks, hw)  # split: a pipelined broadcast to the generator's ranks
    return collective_seconds("broadcast", step.bytes, len(dst.ranks), bandwidth, hw) + step.buckets * hw.latency_s, name


def _stage(stage, plan, groups: Mapping, hw: HardwareProfile) -> tuple[str, float, str]:
    group = groups.get(stage.group)
    if stage.phase == "generate" and group is not None:
        return ("generate", *_generate(stage, group, plan, hw))
    if stage.phase in ("train", "infer") and group is not None:
        return (stage.phase, *_compute(stage, group, plan, hw))
    return "other", hw.stage_overhead_s, "fixed overhead"


def _generate(stage, group, plan, hw: HardwareProfile) -> tuple[float, str]:
    memory = plan.memory.get(group.name, {}).get("generate", {})
    layout = group.generate
    ranks = len(group.ranks)
    prompt, new = plan.sizes["P"], plan.sizes["T"]
    prefill_share = prompt / (prompt + new)
    prefill = stage.flops * prefill_share / (ranks * hw.peak_flops * hw.prefill_efficiency)
    kv_average = memory.get("kv_cache", 0) * (prompt + new / 2) / (prompt + new)
    bandwidth = hw.memory_bandwidth * hw.decode_efficiency * TP_DECODE_SCALING ** math.log2(layout.tp)
    reads = new * (memory.get("params", 0) + kv_average) / bandwidth
    decode_compute = stage.flops * (1 - prefill_share) / (ranks * hw.peak_flops * hw.prefill_efficiency)
    decode = max(reads, decode_compute)
    why = "decode: weights+KV reads" if reads >= decode_compute else "decode: compute"
    return hw.stage_overhead_s + prefill + decode, why


def _compute(stage, group, plan, hw: HardwareProfile) -> tuple[float, str]:
    ranks = len(group.ranks)
    recompute = 4 / 3 if stage.phase == "train" and group.train and group.train.checkpointing else 1.0
    compute = recompute * stage.flops / (ranks * hw.peak_flops * hw.train_efficiency)
    phases = plan.memory.get(group.name, {})
    shards = group.train.fsdp if group.train else ranks
    params = phases.get("train", phases.get(stage.phase, {})).get("params", 0) * shards  # full parameter bytes
    match = _MICRO.search(stage.detail)
    micro = math.prod(int(x) for x in match.groups()) if match else 1
    steps = math.prod(int(x) for x in match.groups()[:2]) if match else 1  # optimizer steps
    # Per micro-batch: an all-gather forward and one backward; the gradients' reduce-scatter runs per
    # micro-batch, or once per optimizer step under `grad_sync_last`. Forward only: one all-gather.
    deferred = stage.phase == "train" and group.train is not None and group.train.grad_sync_last
    collectives = (2 * micro + (steps if deferred else micro)) if stage.phase == "train" else micro
    comm = 0.0
    if shards > 1 and params:
        bandwidth, _ = link(plan.mesh, group.ranks[:shards], group.ranks[:shards], hw)
        comm = collectives * collective_seconds("all_gather", params, shards, bandwidth, hw)
    replicas = group.train.dp if group.train and stage.phase == "train" else 1
    if replicas > 1 and params:  # HSDP: each optimizer step all-reduces the gradient shards across replicas
        peers = group.ranks[::shards]
        bandwidth, _ = link(plan.mesh, peers, peers, hw)
        comm += steps * collective_seconds("all_reduce", params / shards, replicas, bandwidth, hw)
    why = "compute" if compute >= comm else "FSDP traffic"
    return hw.stage_overhead_s + max(compute, comm), why
