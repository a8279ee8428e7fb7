"""`fuse`: choose a fused kernel for every op the kernel registry implements.

A traced op (`group_normalize`, `token_mean`, ...) whose name a registered kernel `implements`
gets `meta["kernel"]`, in the algorithm and in every loss program; the plan prints the choice and
the executors call the kernel through `rlgraph.kernels.registry.dispatch`. Ops without a kernel
run as traced (plain torch).

A kernel may decline one call (`Kernel.declines`: e.g. a loss whose aggregation the kernel does not
implement): that call runs as traced and gets `meta["kernel_declined"]`, the reason the plan prints.

Guarantees: the program's values and specs are unchanged; only `meta["kernel"]` (or
`meta["kernel_declined"]`) is added.
"""

from __future__ import annotations

from typing import Any

from rlgraph.ir import ops
from rlgraph.ir.program import Program, copy_program


def _registry() -> dict[str, Any]:
    """functional op name -> its kernel (`rlgraph.kernels.registry.Kernel`)."""
    try:
        from rlgraph.kernels.registry import available_kernels
    except ImportError:  # kernels are optional: without them nothing is fused
        return {}
    return {kernel.implements: kernel for kernel in available_kernels()}


def _annotate(program: Program, kernels: dict[str, Any]) -> None:
    for node in program.graph.nodes:
        info = ops.op_info(node.target) if node.op == "call_function" else None
        if info is not None and info.name in kernels:
            kernel = kernels[info.name]
            reason = kernel.declines(node.args, dict(node.kwargs)) if kernel.declines else None
            if reason is None:
                node.meta["kernel"] = kernel.name
            else:  # runs as traced; the plan says why it was not fused
                node.meta["kernel_declined"] = f"{info.name} not fused: {reason}"
        if "program" in node.meta:
            _annotate(node.meta["program"], kernels)


def fuse(program: Program, options=None) -> Program:
    out, _ = copy_program(program)
    _annotate(out, _registry())
    return out.verify(after="fuse")
