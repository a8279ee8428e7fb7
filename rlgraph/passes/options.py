"""What a compilation is for: the mesh, the placement policy, concrete sizes and model shapes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from rlgraph.plan.mesh import Colocated, Mesh, Placement


@attrs.frozen
class CompileOptions:
    """`sizes` gives the concrete dims byte counts are computed for: B prompts, n samples per
    prompt, P prompt tokens, T response tokens (N = B*n is derived). `models` maps each model role
    to its HF-style config (a dict) or a preset name."""

    mesh: Mesh = Mesh()
    placement: Placement = Colocated()
    sizes: Mapping[str, int] = attrs.field(factory=lambda: {"B": 32, "n": 8, "P": 8, "T": 8})
    models: Mapping[str, Any] = attrs.field(factory=dict)
    bucket_bytes: int = 512 << 20
    reward_on: str = "controller"

    def concrete(self, n: int | None = None) -> dict[str, int]:
        sizes = dict(self.sizes)
        if n is not None:
            sizes["n"] = n
        sizes["N"] = sizes["B"] * sizes["n"]
        return sizes
