"""`schedule`: lower the placed, resharded program to the ordered `Plan`.

Consecutive nodes of one role and phase form a stage; each transfer and weight sync is its own
step; colocated groups that both generate and train get offload/onload points around
generation. A refill loop (`filter_groups`) becomes a `Loop` over the steps of its region; no
stage mixes nodes inside and outside a loop, so a step either re-runs whole or not at all. Program order is kept (it respects data dependencies by construction); the plan's
steps name the program nodes they run, so an executor walking the plan runs exactly the program.
"""

from __future__ import annotations

import operator

import torch.fx as fx

from rlgraph.ir import specs as S
from rlgraph.ir.primitives import primitive_name
from rlgraph.ir.printer import op_name
from rlgraph.ir.program import Program
from rlgraph.ir.trace import get_field
from rlgraph.passes.options import CompileOptions
from rlgraph.passes.partition import CONTROLLER
from rlgraph.plan.mesh import Colocated
from rlgraph.plan.plan import Loop, Offload, Plan, Stage, SyncWeights, Transfer


def _stage_key(node: fx.Node) -> tuple[str, str]:
    phase = node.meta["phase"]
    return node.meta["role"], ("controller" if phase == "math" and node.meta["role"] == CONTROLLER else phase)


def _loop_steps(program: Program, steps: list) -> tuple[Loop, ...]:
    """The plan's loops: the steps that run each refill region's nodes, and the filter's step."""
    step_of: dict[str, int] = {}
    for step in steps:
        if isinstance(step, Stage):
            step_of.update({name: step.index for name in step.nodes})
    step_of.update({node.name: node.meta["step"] for node in program.graph.nodes if "step" in node.meta})
    return tuple(Loop(tuple(sorted({step_of[name] for name in loop.nodes})), step_of[loop.filter], loop.prompts,
                      loop.max_rounds) for loop in program.annotations.get("loops", ()))


def _detail(node: fx.Node, program: Program, options: CompileOptions, sizes: dict[str, int]) -> tuple[str, float]:
    from rlgraph.passes.memory_plan import batch_rows, model_shape

    prim = primitive_name(node)
    groups = {group.name: group for group in program.annotations["groups"]}
    if prim is None or prim == "score":
        return "", 0.0
    if prim == "filter_groups":
        return f"keep the groups where keep is True; refill to B={sizes['B']} groups from fresh prompts", 0.0
    group = groups[node.meta["role"]]
    role = node.args[0].meta["spec"].role
    shape = model_shape(options, role)
    batch = batch_rows(node, sizes)  # B for an n=1 generation, N otherwise
    tokens = batch * (sizes["P"] + sizes["T"])
    if prim == "generate":
        layout = group.generate
        samples = sizes["B"] * node.kwargs["n"]  # this generate's own n (a greedy baseline has n=1)
        per_replica = -(-samples // layout.dp)
        flops = shape.flops_per_token(sizes["P"] + sizes["T"], training=False) * samples * (sizes["P"] + sizes["T"])
        return (f"{samples} samples ({sizes['B']} prompts x n={node.kwargs['n']}), <= {sizes['T']} new tokens; "
                f"{layout.dp} replica(s) x tp={layout.tp}, {per_replica} sequences each"), flops
    if prim in ("logprobs", "values"):
        return f"forward only, {-(-batch // group.dp)} sequences/rank", shape.flops_per_token(sizes["P"] + sizes["T"], training=False) * tokens
    kwargs = node.kwargs
    rows = -(-batch // group.dp)
    per_mini = -(-rows // kwargs["minibatches"])
    micro = kwargs["micro_batch_size"] or per_mini
    count = -(-per_mini // micro)
    loss = node.meta["program"].name
    text = (f"loss {loss}: {kwargs['epochs']} epoch(s) x {kwargs['minibatches']} minibatch(es) x {count} micro-batch(es) "
            f"of {min(micro, per_mini)} rows/rank; grad clip {kwargs['grad_clip']}")
    return text, shape.flops_per_token(sizes["P"] + sizes["T"], training=True) * tokens * kwargs["epochs"]


def _kernels(node: fx.Node) -> list[str]:
    found = [node.meta["kernel"]] if "kernel" in node.meta else []
    if "program" in node.meta:
        found += [f"{n.meta['kernel']} (in {node.meta['program'].name})" for n in node.meta["program"].graph.nodes if "kernel" in n.meta]
    return found


def schedule(program: Program, options: CompileOptions) -> Plan:
    sizes = options.concrete(program.hparams.get("n"))
    memory = program.annotations["memory"]
    region = {name for loop in program.annotations.get("loops", ()) for name in loop.nodes}
    steps: list = []
    current: dict | None = None

    def close() -> None:
        nonlocal current
        if current:
            steps.append(Stage(len(steps), current["role"], current["phase"], tuple(current["nodes"]), tuple(current["ops"]),
                               current["detail"], current["flops"], tuple(current["kernels"])))
        current = None

    offloaded: set[str] = set()
    for node in program.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.meta.get("transfer"):
            close()
            kw = node.kwargs
            steps.append(Transfer(len(steps), kw["kind"], node.args[0].name, str(node.meta["spec"]), kw["src"], kw["dst"], kw["nbytes"]))
            _name_step(node, steps[-1])
            continue
        if node.meta.get("sync"):
            close()
            kw = node.kwargs
            steps.append(SyncWeights(len(steps), node.args[0].meta["spec"].role, str(node.meta["spec"]), kw["src"], kw["dst"], kw["nbytes"], kw["buckets"]))
            _name_step(node, steps[-1])
            continue
        if node.target is operator.getitem and isinstance(node.meta["spec"], (S.ModelSpec, S.StatsSpec)) or (
            node.target is operator.getitem and isinstance(node.args[0].meta.get("spec"), S.TupleSpec)):
            current["nodes"].append(node.name) if current else None
            continue
        role, phase = _stage_key(node)
        if isinstance(options.placement, Colocated) and options.placement.offload and phase in ("generate", "train"):
            _offload_points(steps, close, role, phase, memory, offloaded)
        looped = node.name in region  # a stage is wholly inside a refill loop or wholly outside
        if current is None or (current["role"], current["phase"], current["looped"]) != (role, phase, looped):
            close()
            current = {"role": role, "phase": phase, "looped": looped, "nodes": [], "ops": [], "detail": "", "flops": 0.0,
                       "kernels": []}
        current["nodes"].append(node.name)
        current["ops"].append(f"{node.name}=.{node.args[1]}" if node.target is get_field else f"{node.name}={op_name(node)}")
        detail, flops = _detail(node, program, options, sizes)
        current["detail"] = "; ".join(text for text in (current["detail"], detail) if text)
        current["flops"] += flops
        current["kernels"].extend(_kernels(node))
    close()
    notes = ("offload/onload: optimizer state and gradients leave the device while the colocated generator runs",) if isinstance(options.placement, Colocated) and options.placement.offload else ()
    return Plan(program.name, options.mesh, _placement_text(options), program.annotations["groups"],
                {k: sizes[k] for k in ("B", "n", "N", "P", "T")}, tuple(steps), memory, notes, _loop_steps(program, steps))


def _name_step(node: fx.Node, step) -> None:
    node.meta["step"] = step.index


def _offload_points(steps, close, role, phase, memory, offloaded) -> None:
    phases = memory.get(role, {})
    if "train" not in phases or "generate" not in phases:
        return
    parked = phases["train"].get("optimizer", 0) + phases["train"].get("grads", 0) + phases["train"].get("master_weights", 0)
    if phase == "generate" and role not in offloaded:
        close()
        steps.append(Offload(len(steps), role, "optimizer+grads", "offload", parked))
        offloaded.add(role)
    elif phase == "train" and role in offloaded:
        close()
        steps.append(Offload(len(steps), role, "optimizer+grads", "onload", parked))
        offloaded.discard(role)


def _placement_text(options: CompileOptions) -> str:
    placement = options.placement
    if isinstance(placement, Colocated):
        return f"colocated(fsdp={placement.fsdp or options.mesh.size}, tp={placement.tp}, offload={placement.offload})"
    name = type(placement).__name__.lower()
    groups = getattr(placement, "groups", {})
    if isinstance(groups, dict):
        return f"{name}({groups})"
    return f"{name}({', '.join(group.name for group in groups)})"
