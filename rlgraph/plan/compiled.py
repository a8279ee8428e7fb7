"""`Compiled`: a traced algorithm lowered for one mesh and placement, as the runtime receives it.

It lives with the plan (not with the passes that make it) so that the runtime, which executes
it, depends on the plan layer only. `rlgraph.passes.pipeline.compile_program` builds it.
"""

from __future__ import annotations

from typing import Any

import attrs

from rlgraph.ir.program import Program
from rlgraph.plan.plan import Plan


@attrs.frozen
class Compiled:
    """A traced algorithm lowered for one mesh and placement: inspect it, then run it."""

    source: Program
    program: Program  # after every pass: placed, resharded, fused
    plan: Plan
    options: Any  # the `rlgraph.passes.options.CompileOptions` it was lowered with
    search: object = None  # `rlgraph.passes.search.SearchResult` when the placement was "auto"

    def as_text(self) -> str:
        return self.plan.as_text() + (f"\n{self.search.text()}" if self.search is not None else "")

    def cost_analysis(self, hardware=None):
        """Estimated seconds per step and phase (`rlgraph.plan.cost.CostAnalysis`)."""
        return self.plan.cost_analysis(hardware)

    def memory_analysis(self) -> dict[str, dict[str, dict[str, int]]]:
        return self.plan.memory_analysis()

    def to_dot(self) -> str:
        return self.plan.to_dot()

    def __str__(self) -> str:
        return self.as_text()
