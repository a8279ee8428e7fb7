"""Inspect the plan of a 70B PPO run before spending GPU hours: which ranks hold which role, what
moves between them each step, and each rank's memory against an 80 GiB H100.

    python examples/plan_70b_ppo.py
    rlgraph plan ppo --model llama3-70b --mesh 8x8:h100 --sizes B=48,P=1024,T=2048 -p n=4 \\
        -p micro_batch_size=1 --placement split:policy=24,rollout=16,critic=24,tp=8,checkpointing=True

Nothing runs and nothing is downloaded: the models are preset shapes (rlgraph.plan.presets).
The first placement tried (4 nodes, 8 ranks for the critic) is refused by the compiler with the
memory it would need and what to change; the second fits.
"""

from __future__ import annotations

from typing import Any

import rlgraph as rg
from rlgraph.algorithms import ppo
from rlgraph.plan.memory import PlacementError
from rlgraph.plan.mesh import split

MODELS = {"policy": "llama3-70b", "critic": "llama3-70b"}
SIZES = {"B": 48, "P": 1024, "T": 2048}


def main() -> Any:
    try:
        rg.compile(ppo, mesh="4x8:h100", placement=split({"policy": 16, "rollout": 8, "critic": 8}, tp=8),
                   sizes=SIZES, models=MODELS, n=4)
        raise AssertionError("a 70B critic trained on 8 H100s was expected not to fit")
    except PlacementError as refused:
        print(f"4x8 H100, critic on 8 ranks: refused\n  {str(refused).splitlines()[0]}\n")
    compiled = rg.compile(ppo, mesh="8x8:h100", placement=split({"policy": 24, "rollout": 16, "critic": 24}, tp=8,
                                                                   checkpointing=True),
                          sizes=SIZES, models=MODELS, n=4, micro_batch_size=1)
    print(compiled.as_text())
    for group, phases in compiled.memory_analysis().items():
        peak = max(phase["total"] for phase in phases.values())
        print(f"{group:8s} peak {peak / 2**30:6.1f} GiB of 80 GiB")
    return compiled


if __name__ == "__main__":
    main()
