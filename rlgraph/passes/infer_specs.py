"""`infer_specs`: recompute every node's spec from its inputs and check it matches the trace.

Guarantees: every node has a spec consistent with its op's rule; a pass that rewired a node to
operands of another shape is caught here, naming the node.
"""

from __future__ import annotations

from rlgraph.ir import specs as S
from rlgraph.errors import VerifyError
from rlgraph.ir.program import Program, copy_program
from rlgraph.ir.infer import infer


def infer_specs(program: Program, options=None) -> Program:
    out, _ = copy_program(program)
    for node in out.graph.nodes:
        if node.op in ("call_function", "call_method") and node.meta.get("inferred", True):
            if node.meta.get("transfer") or node.meta.get("sync"):
                continue
            spec = infer(node)
            if isinstance(node.meta["spec"], S.TupleSpec) and not isinstance(spec, S.TupleSpec):
                raise VerifyError(f"{node.name}: spec changed from {node.meta['spec']} to {spec}")
            if spec != node.meta["spec"]:
                raise VerifyError(f"{node.name}: traced spec {node.meta['spec']} but inputs give {spec}")
    for _, sub in out.subprograms():
        infer_specs(sub)
    return out.verify(after="infer_specs")
