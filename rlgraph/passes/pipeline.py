"""The compiler pipeline, top to bottom, and the `Compiled` result.

    program --infer_specs--> --pack--> --partition--> --place--> --reshard--> --fuse--> --loops--> --overlap--> --schedule--> Plan

Each pass is a pure function `(Program, CompileOptions) -> Program` that ends by verifying its
output; `schedule` lowers to the `Plan`, and `Compiled` (`rlgraph.plan.compiled`) holds both.
Nothing here runs a model.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from rlgraph.ir.program import Program
from rlgraph.passes.fuse import fuse
from rlgraph.passes.infer_specs import infer_specs
from rlgraph.passes.loops import loops
from rlgraph.passes.options import CompileOptions
from rlgraph.passes.overlap import overlap
from rlgraph.passes.pack import pack
from rlgraph.passes.partition import partition
from rlgraph.passes.place import place
from rlgraph.passes.reshard import reshard
from rlgraph.passes.schedule import schedule
from rlgraph.plan.compiled import Compiled

PIPELINE: list[tuple[str, Callable[[Program, CompileOptions], Program]]] = [
    ("infer_specs", infer_specs),
    ("pack", pack),  # micro_batch_tokens only: packed micro-batches on every model forward
    ("partition", partition),
    ("place", place),
    ("reshard", reshard),
    ("fuse", fuse),
    ("loops", loops),
    ("overlap", overlap),  # staleness >= 1 only: the rollout and train lanes
]


def compile_program(program: Program, options: CompileOptions, *, top_k: int = 3) -> Compiled:
    """Run the pipeline; `placement="auto"` searches the placements (`rlgraph.passes.search`) and
    returns the fastest, with the search's ranking in `Compiled.search`."""
    if isinstance(options.placement, str):
        from rlgraph.passes.search import check_auto, search

        check_auto(options.placement)
        checked = infer_specs(program, options)  # independent of the placement: run once
        result = search(checked, options, lambda prog, trial: _lower(program, prog, trial, PIPELINE[1:]), top_k=top_k)
        return attrs.evolve(result.best.compiled, search=result)
    return _lower(program, program, options, PIPELINE)


def _lower(source: Program, program: Program, options: CompileOptions, passes) -> Compiled:
    lowered = program
    for _name, run_pass in passes:
        lowered = run_pass(lowered, options)
    return Compiled(source, lowered, schedule(lowered, options), options)
