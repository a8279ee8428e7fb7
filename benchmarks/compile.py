"""How long does compiling take? Trace + all passes + plan, per algorithm and placement.

    .venv/bin/python benchmarks/compile.py
"""

import statistics
import time

import rlgraph as rg
from rlgraph.algorithms import ALGORITHMS

CASES = [
    ("colocated gpu:8", "gpu:8", rg.colocated()),
    ("split 4+4", "gpu:8", rg.split({"policy": 4, "rollout": 4, "ref": "policy", "critic": "policy"})),
    ("2 nodes x 8, tp=2", "2x8:h100", rg.colocated(tp=2)),
]


def main() -> None:
    names = [name for name in ("grpo", "ppo") if name in ALGORITHMS]
    print(f"{'algorithm':<10} {'placement':<20} {'median ms':>10} {'min ms':>8}")
    for name in names:
        for label, mesh, placement in CASES:
            times = []
            for _ in range(15):
                start = time.perf_counter()
                rg.compile(ALGORITHMS[name], mesh=mesh, placement=placement, sizes={"B": 64, "P": 512, "T": 1024, "n": 8},
                           models={"policy": "llama3-8b"}, kl=0.001, micro_batch_size=4)
                times.append((time.perf_counter() - start) * 1e3)
            print(f"{name:<10} {label:<20} {statistics.median(times):>10.1f} {min(times):>8.1f}")


if __name__ == "__main__":
    main()
