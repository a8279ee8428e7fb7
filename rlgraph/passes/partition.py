"""`partition`: assign every node to a role (the worker group that runs it) and a phase.

Primitives run on the role of their model (`generate` on the policy's generator, `rollout`,
when the placement has one); `score` with a reward function and `filter_groups` run on the
controller. Field reads
stay with their record. Any other op runs where its inputs already are, choosing the location
that moves the fewest bytes (ties go to the controller, which holds the metrics).

Guarantees: every node has `meta["role"]` and `meta["phase"]`; nothing else changes.
"""

from __future__ import annotations

import torch.fx as fx

from rlgraph.ir import specs as S
from rlgraph.ir.primitives import primitive_name
from rlgraph.ir.program import Program, copy_program
from rlgraph.ir.trace import get_field
from rlgraph.passes.options import CompileOptions

CONTROLLER = "controller"
PHASES = {"generate": "generate", "logprobs": "infer", "values": "infer", "score": "reward", "update": "train",
          "filter_groups": "filter"}


def value_bytes(spec: S.Spec, sizes: dict[str, int]) -> int:
    """Bytes of one value at concrete sizes (records count all their fields; handles are free)."""
    if isinstance(spec, S.TensorSpec):
        return spec.nbytes(sizes)
    if isinstance(spec, S.RecordSpec):
        return sum(field.nbytes(sizes) for _, field in spec.fields)
    return 0


def generator_role(role: str, options: CompileOptions) -> str:
    groups = getattr(options.placement, "groups", None)
    names = set(groups) if isinstance(groups, dict) else {g.name for g in groups or ()}
    return "rollout" if role == "policy" and "rollout" in names else role


def _role_of_primitive(node: fx.Node, name: str, options: CompileOptions) -> str:
    if name == "filter_groups":
        return CONTROLLER  # it holds the kept groups across refill rounds
    model = node.args[0].meta["spec"]
    if name == "generate":
        return generator_role(model.role, options)
    if name == "score":
        return options.reward_on
    return model.role


def _cheapest(node: fx.Node, sizes: dict[str, int]) -> str:
    moved: dict[str, int] = {CONTROLLER: 0}
    inputs = [arg for arg in node.all_input_nodes]
    for candidate in {arg.meta["role"] for arg in inputs} | {CONTROLLER}:
        moved[candidate] = sum(value_bytes(arg.meta["spec"], sizes) for arg in inputs if arg.meta["role"] != candidate)
    return min(moved, key=lambda role: (moved[role], role != CONTROLLER))


def partition(program: Program, options: CompileOptions) -> Program:
    out, _ = copy_program(program)
    sizes = options.concrete(program.hparams.get("n"))
    for node in out.graph.nodes:
        if node.op == "output":
            continue
        spec = node.meta["spec"]
        prim = primitive_name(node)
        if node.op == "placeholder":
            role = spec.role if isinstance(spec, (S.ModelSpec,)) else CONTROLLER
            node.meta.update(role=role, phase="input")
        elif prim is not None:
            node.meta.update(role=_role_of_primitive(node, prim, options), phase=PHASES[prim])
        elif node.target is get_field or (isinstance(node.args[0], fx.Node) and not isinstance(node.args[0].meta["spec"], S.TensorSpec)):
            phase = node.args[0].meta["phase"]  # reads of the filter's results are controller math, not more filtering
            node.meta.update(role=node.args[0].meta["role"], phase="math" if phase == "filter" else phase)
        else:
            node.meta.update(role=_cheapest(node, sizes), phase="math")
    return out.verify(after="partition")
