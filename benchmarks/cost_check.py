"""The cost model's CPU estimate of the demo's GRPO step against the measured step, per phase.

    .venv/bin/python benchmarks/cost_check.py [--rounds 3] [--steps 10] [--threads 2]

Runs the demo configuration (tiny Qwen2, 32 prompts x 8 samples, 5 new tokens, AdamW 1e-4, random
init so every response runs the full 5 tokens) through the local runtime's `PlanRunner`, times every
plan step, and prints beside each phase the estimate of `compiled.cost_analysis()` (the `cpu`
hardware profile). Exits 1 if the total estimate is more than 30% off the median measured step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import rlgraph as rg
from rlgraph.algorithms import ALGORITHMS
from rlgraph.backends.world import RoleSpec, WorldSpec
from rlgraph.runtime.plan_runner import PlanRunner
from rlgraph.testing.tiny import length_parity_reward, tiny_prompts

B, N_SAMPLES, TOKENS = 32, 8, 5


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    compiled = rg.compile(ALGORITHMS["grpo"], mesh="cpu:1", placement=rg.colocated(offload=False, checkpointing=False),
                          sizes={"B": B, "P": 8, "T": TOKENS}, n=N_SAMPLES, max_new_tokens=TOKENS, engine="native")
    world = WorldSpec({"policy": RoleSpec(optimizer="adamw", lr=1e-4)}, {"reward": length_parity_reward}, max_new_tokens=TOKENS)
    runner, prompts = PlanRunner(compiled, world.build_local()), tiny_prompts(B)
    for _ in range(2):  # warm-up
        runner.run(prompts)
    runner.step_seconds.clear()
    rounds = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        for _ in range(args.steps):
            runner.run(prompts)
        rounds.append((time.perf_counter() - start) / args.steps)
    measured = statistics.median(rounds)
    cost = compiled.cost_analysis()
    runs = args.rounds * args.steps
    by_phase: dict[str, float] = {}
    for step in cost.steps:
        by_phase[step.phase] = by_phase.get(step.phase, 0.0) + runner.step_seconds.get(step.index, 0.0) / runs
    print(f"{'phase':<14} {'estimate ms':>12} {'measured ms':>12}")
    for phase, seconds in sorted(by_phase.items(), key=lambda item: -item[1]):
        print(f"{phase:<14} {cost.phases.get(phase, 0.0) * 1e3:12.2f} {seconds * 1e3:12.2f}")
    error = cost.total / measured - 1
    print(f"{'step':<14} {cost.total * 1e3:12.2f} {measured * 1e3:12.2f}   error {error:+.1%} "
          f"(median of {args.rounds} rounds x {args.steps} steps, {args.threads} threads)")
    return 0 if abs(error) <= 0.3 else 1


if __name__ == "__main__":
    sys.exit(main())
