"""Per-rank memory of every group and phase of a placed program (used by `place`).

Bridges the program (which roles train, infer and generate, with which micro-batches) and the
memory model of `rlgraph.plan.memory`. Colocated groups share ranks: their phases are combined
with `colocated_peak`, and the result is checked against the device capacity.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlgraph.ir import specs as S
from rlgraph.ir.primitives import primitive_name
from rlgraph.ir.program import Program
from rlgraph.passes.options import CompileOptions
from rlgraph.plan import memory as M
from rlgraph.plan.mesh import Group, Mesh
from rlgraph.plan.model_size import ModelShape
from rlgraph.plan.presets import load_model_config

_DEFAULT_MODEL = "tiny-qwen2"


def model_shape(options: CompileOptions, role: str) -> ModelShape:
    source = options.models.get(role) or options.models.get("policy") or _DEFAULT_MODEL
    config = source if isinstance(source, dict) else load_model_config(source)
    return ModelShape.from_hf_config(config)


def param_dtype(mesh: Mesh) -> torch.dtype:
    return torch.float32 if mesh.device == "cpu" else torch.bfloat16


def param_bytes(shape: ModelShape, mesh: Mesh) -> int:
    return shape.n_params * torch.empty((), dtype=param_dtype(mesh)).element_size()


def batch_rows(node, sizes: dict[str, int]) -> int:
    """Rows a primitive works on at concrete sizes: its rollouts' row dim (B for `n=1` generations
    such as ReMax's greedy baseline, N otherwise)."""
    record = node.meta["spec"] if primitive_name(node) == "generate" else node.args[1].meta["spec"]
    return sizes[str(record.rows)] if isinstance(record, S.RecordSpec) else sizes["N"]


def _phase_memory(program: Program, group: Group, options: CompileOptions) -> dict[str, M.MemoryBreakdown]:
    """The peak of each phase of `group`: the largest over the primitives of that phase (ReMax's two
    generations, two updates of one role), each sized by its own batch rows."""
    sizes = options.concrete(program.hparams.get("n"))
    seq = sizes["P"] + sizes["T"]
    dtype = param_dtype(options.mesh)
    phases: dict[str, M.MemoryBreakdown] = {}
    for node in program.graph.nodes:
        prim = primitive_name(node)
        if prim is None or node.meta.get("role") != group.name or prim in ("score", "filter_groups"):
            continue
        shape = model_shape(options, node.args[0].meta["spec"].role)
        batch = batch_rows(node, sizes)
        rows = -(-batch // group.dp)
        if prim == "update":
            per_mini = -(-rows // node.kwargs["minibatches"])
            micro = min(node.kwargs["micro_batch_size"] or per_mini, per_mini)
            config = M.TrainMemoryConfig(
                param_dtype=dtype, mixed_precision=dtype != torch.float32, fsdp_shards=group.train.fsdp,
                checkpointing=group.train.checkpointing, micro_batch_tokens=micro * seq, seq_len=seq,
            )
            phase, breakdown = "train", M.train_memory(shape, config)
        elif prim == "generate":
            replicas = group.generate.dp
            phase, breakdown = "generate", M.generate_memory(shape, tp=group.generate.tp, batch_sequences=-(-batch // replicas),
                                                             max_seq_len=seq, dtype=dtype, prompt_len=sizes["P"])
        else:
            phase, breakdown = "infer", M.infer_memory(shape, batch_tokens=rows * seq, dtype=dtype, shards=len(group.ranks))
        if phase not in phases or breakdown.total > phases[phase].total:
            phases[phase] = breakdown
    return phases


def plan_memory(program: Program, groups: Sequence[Group], options: CompileOptions) -> dict[str, dict[str, dict[str, int]]]:
    """group -> phase -> {part: bytes, total}; raises `PlacementError` if a rank cannot hold its peak."""
    per_group = {group.name: _phase_memory(program, group, options) for group in groups}
    by_ranks: dict[tuple[int, ...], dict[str, M.MemoryBreakdown]] = {}
    for group in groups:
        for phase, breakdown in per_group[group.name].items():
            by_ranks.setdefault(group.ranks, {})[f"{group.name}.{phase}"] = breakdown
    offload = bool(getattr(options.placement, "offload", False))
    for ranks, phases in by_ranks.items():
        peak = M.colocated_peak(phases, offload=offload) if len(phases) > 1 else next(iter(phases.values()))
        roles = "+".join(sorted({name.split(".")[0] for name in phases}))
        M.check_fits(roles, ranks[0], peak, options.mesh.capacity_bytes)
    return {name: {phase: breakdown.as_dict() for phase, breakdown in phases.items()} for name, phases in per_group.items()}
