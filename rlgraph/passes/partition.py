"""`partition`: assign every node to a role (the worker group that runs it) and a phase.

Primitives run on the role of their model (`generate` on the policy's generator, `rollout`,
when the placement has one); `score` with a reward function and `filter_groups` run on the
controller. Field reads
stay with their record. Any other op runs where its inputs already are, choosing the location
that moves the fewest bytes (ties go to the controller, which holds the metrics), with one rule
for correctness: a worker group holds per-row values split across its data-parallel ranks, so an
op reading per-row inputs may run there only when each output row depends on its own row or its
own group's rows (elementwise math, `@traceable(rows=...)` ops such as `group_normalize` or
`gae`). A batch statistic (`masked_whiten`, `mean`, ...) runs on the controller over the whole
batch: computed on one shard it would be silently wrong.

Guarantees: every node has `meta["role"]` and `meta["phase"]`; nothing else changes.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from rlgraph.ir import ops
from rlgraph.ir import specs as S
from rlgraph.ir.primitives import GENERATORS, primitive_name
from rlgraph.ir.program import Program, copy_program
from rlgraph.ir.infer import get_field
from rlgraph.passes.options import CompileOptions
from rlgraph.plan.layouts import CONTROLLER

PHASES = {"generate": "generate", "rollout": "generate", "logprobs": "infer", "values": "infer", "score": "reward", "update": "train",
          "optimizer_step": "train", "filter_groups": "filter"}


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
    if name in GENERATORS:
        return generator_role(model.role, options)
    if name == "score":
        return options.reward_on
    return model.role


# Elementwise torch math: output row i reads input row i (and values without rows, broadcast).
_ROW_FUNCTIONS = {operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow,
                  torch.add, torch.sub, torch.mul, torch.div, torch.exp, torch.log, torch.clamp, torch.minimum,
                  torch.maximum, torch.where, torch.abs, torch.sigmoid, torch.tanh, torch.sqrt, torch.square}
_ROW_METHODS = {"exp", "log", "clamp", "abs", "sqrt", "square", "sigmoid", "tanh", "neg", "float", "double", "to", "bool",
                "long", "int", "add", "sub", "mul", "div"}


def _reads_whole_batch(node: fx.Node) -> bool:
    """Whether an op on per-row inputs needs rows beyond each output row's own (or its group's)."""
    if not any(_per_row(arg.meta["spec"]) for arg in node.all_input_nodes):
        return False
    if node.op == "call_method":
        return node.target not in _ROW_METHODS
    if node.target is operator.getitem:
        index = node.args[1]
        first = index[0] if isinstance(index, tuple) and index else index
        return first != slice(None)  # [:, None] or [:, 1:] keep rows; [0] or [mask] do not
    info = ops.op_info(node.target)
    if info is not None:
        return info.rows is None
    return node.target not in _ROW_FUNCTIONS


def _per_row(spec: S.Spec) -> bool:
    return isinstance(spec, S.TensorSpec) and spec.shape[:1] in ((S.N,), (S.B,))


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
        elif _reads_whole_batch(node):
            node.meta.update(role=CONTROLLER, phase="math")
        else:
            node.meta.update(role=_cheapest(node, sizes), phase="math")
    return out.verify(after="partition")
