"""`loops`: find the refill loop of every `filter_groups` node of the lowered program.

The loop re-runs the filter's *refill region* (its ancestors that depend on the prompts) on
fresh prompts. The tracer already found it for the eager interpreter; this pass finds it again
after `reshard`, so the region includes the collectives that move its values (scattering the
prompts, gathering the rollouts), and `schedule` can print it as a loop over plan steps.

Guarantees: `annotations["loops"]` holds one `RefillLoop` per `filter_groups` node (none: the
key is absent); no value of a region is used after the loop except by the filter itself.
"""

from __future__ import annotations

from rlgraph.errors import VerifyError
from rlgraph.ir.primitives import refill_loops
from rlgraph.ir.program import Program, copy_program


def loops(program: Program, options=None) -> Program:
    found = refill_loops(program.graph)
    annotations = {key: value for key, value in program.annotations.items() if key != "loops"}
    out, _ = copy_program(program, annotations={**annotations, **({"loops": found} if found else {})})
    _check_closed(out)
    return out.verify(after="loops")


def _check_closed(program: Program) -> None:
    """Each region's values feed only the region, the filter, or dead nodes (the tracer checked
    the user's program; a pass that rewired an edge across the loop boundary is caught here)."""
    nodes = {node.name: node for node in program.graph.nodes}
    for loop in program.annotations.get("loops", ()):
        region = set(loop.nodes)
        for name in loop.nodes:
            for user in nodes[name].users:
                if user.name not in region and user.name != loop.filter and (user.users or user.op == "output"):
                    raise VerifyError(f"{user.name} uses {name} of the refill loop of {loop.filter} from outside the "
                                      "loop (after pass `loops`)")
