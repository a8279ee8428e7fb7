"""`Program`: a traced algorithm (or loss closure) as an `fx.Graph` plus a signature and node specs.

Node metadata (`node.meta`):
- `"spec"`: the value's spec (`rlgraph.ir.specs`), on every node but the output;
- `"source"`: the user's `SourceLocation` that produced it (absent for placeholders made by rlgraph);
- `"program"`: on `update` nodes, the loss closure's own `Program`.

Outputs: an algorithm returns `(state, metrics)`, recorded as the output node's argument
`({role: node}, {metric: node})`; a loss program returns `(loss, {metric: node})`. An algorithm
that also returns values to its caller (`(state, metrics, outputs)`: per-token log-probs,
rollouts) keeps them in the output node's `outputs` keyword (`Program.outputs`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import torch
import torch.fx as fx

from rlgraph.ir import specs as S
from rlgraph.errors import VerifyError


@attrs.frozen(eq=False)
class Program:
    name: str
    graph: fx.Graph
    kind: str = "algorithm"  # algorithm | loss
    hparams: Mapping[str, Any] = attrs.field(factory=dict)
    annotations: Mapping[str, Any] = attrs.field(factory=dict)  # program-level facts passes add

    # -- structure ---------------------------------------------------------------------------
    @property
    def nodes(self) -> list[fx.Node]:
        return list(self.graph.nodes)

    @property
    def inputs(self) -> list[fx.Node]:
        return [node for node in self.graph.nodes if node.op == "placeholder"]

    @property
    def output(self) -> fx.Node:
        return next(node for node in reversed(self.graph.nodes) if node.op == "output")

    @property
    def result(self) -> tuple[Any, Mapping[str, fx.Node]]:
        """`(state or loss, metrics)` as nodes."""
        return self.output.args[0]

    @property
    def outputs(self) -> Mapping[str, fx.Node]:
        """The values handed back to the caller whole, by name (empty for most algorithms)."""
        return self.output.kwargs.get("outputs", {})

    def spec(self, node: fx.Node) -> S.Spec:
        return node.meta["spec"]

    def subprograms(self) -> Iterator[tuple[fx.Node, Program]]:
        for node in self.graph.nodes:
            if "program" in node.meta:
                yield node, node.meta["program"]

    def primitive_nodes(self, name: str | None = None) -> list[fx.Node]:
        from rlgraph.ir.primitives import primitive_name

        found = []
        for node in self.graph.nodes:
            prim = primitive_name(node)
            if prim is not None and (name is None or prim == name):
                found.append(node)
        return found

    # -- printing ----------------------------------------------------------------------------
    def pretty(self, *, source: bool = False) -> str:
        from rlgraph.ir.printer import format_program

        return format_program(self, source=source)

    def __str__(self) -> str:
        return self.pretty()

    def __repr__(self) -> str:
        return f"<Program {self.name}: {len(self.graph.nodes)} nodes>"

    def verify(self, after: str | None = None) -> Program:
        verify(self, after=after)
        return self


def verify(program: Program, *, after: str | None = None) -> None:
    """Check the invariants every pass must keep; the error names the pass that broke one.

    - every non-output node has a spec, and the graph is well formed (fx lint: defs before uses);
    - a model version is consumed only while it is the newest version of its role
      (no use of `policy@v` after `policy@v+1` exists: the executors hold one live copy);
    - the output is `(state, metrics)` for algorithms, `(scalar loss, metrics)` for losses.
    """
    where = f" (after pass `{after}`)" if after else ""
    try:
        program.graph.lint()
    except Exception as exc:  # fx raises RuntimeError with its own text
        raise VerifyError(f"program {program.name} is malformed{where}: {exc}") from exc
    newest: dict[str, int] = {}
    for node in program.graph.nodes:
        if node.op == "output":
            continue
        spec = node.meta.get("spec")
        if spec is None:
            raise VerifyError(f"node {node.name} of {program.name} has no spec{where}")
        for arg in node.all_input_nodes:
            arg_spec = arg.meta.get("spec")
            if isinstance(arg_spec, S.ModelSpec) and newest.get(arg_spec.role, -1) > arg_spec.version:
                source = node.meta.get("source")  # the user's line, as every trace error names it
                at = f"\n  at {source} in {source.function}():  {source.code}" if source is not None else ""
                raise VerifyError(
                    f"{node.name} uses {arg_spec} after {arg_spec.role}@v+{newest[arg_spec.role]} was produced"
                    f"{where}; only the newest version of a model exists on its workers{at}\n  fix: read the "
                    f"version rg.update returned ({arg_spec.role}@v+1) instead of state.{arg_spec.role}, or move "
                    "this call before the update"
                )
        if isinstance(spec, S.ModelSpec):
            newest[spec.role] = max(newest.get(spec.role, -1), spec.version)
        if "program" in node.meta:
            verify(node.meta["program"], after=after)
    result = program.output.args[0]
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict)):
        raise VerifyError(f"program {program.name} must return (value, metrics){where}")
    if program.kind == "loss":
        loss_spec = result[0].meta["spec"]
        if not (isinstance(loss_spec, S.TensorSpec) and loss_spec.shape == () and loss_spec.dtype.is_floating_point):
            raise VerifyError(f"loss program {program.name} must return a float scalar, got {loss_spec}{where}")


def copy_program(program: Program, **changes: Any) -> tuple[Program, dict[fx.Node, fx.Node]]:
    """A deep copy (graph, node meta, nested loss programs) so a pass never edits its input.

    Returns the copy and the map old node -> new node.
    """
    graph = fx.Graph()
    mapping: dict[fx.Node, fx.Node] = {}
    result = graph.graph_copy(program.graph, mapping)
    output = graph.output(result)
    if program.outputs:
        output.kwargs = {"outputs": {key: mapping[node] for key, node in program.outputs.items()}}
    for old, new in mapping.items():
        new.meta = dict(old.meta)
        if "program" in old.meta:
            sub, sub_map = copy_program(old.meta["program"])
            for node in sub.graph.nodes:
                if "lifted_from" in node.meta:
                    node.meta["lifted_from"] = mapping.get(node.meta["lifted_from"], node.meta["lifted_from"])
            new.meta["program"] = sub
    fields = dict(name=program.name, graph=graph, kind=program.kind, hparams=dict(program.hparams),
                  annotations=dict(program.annotations))
    fields.update(changes)
    return Program(**fields), mapping


def constant(value: torch.Tensor) -> torch.Tensor:
    """Target of nodes that hold a tensor constant captured by the user's code."""
    return value
