"""The demo's GRPO step alone (32 prompts x 8 samples x 5 tokens, `rlgraph demo`'s executor and
plan, no warm start): the median of STEPS steps after 3 warm-up ones, and the generate stage's mean.
Run it from two worktrees in turn to compare trees (docs/benchmarks.md, issue 24):

    PYTHONPATH=$PWD .venv/bin/python benchmarks/demo_step.py 30 1      # steps, torch threads
"""

import statistics
import sys
import time

import torch

from rlgraph.backends.world import make_optimizer
from rlgraph.data import arithmetic
from rlgraph.runtime.plan_runner import PlanRunner
from rlgraph.train.demo import DemoConfig, add_reference, build_roles, compile_rl


def main(steps: int, threads: int) -> None:
    config = DemoConfig(threads=threads)
    torch.manual_seed(0)
    torch.set_num_threads(threads)
    executor, tokenizer = build_roles(config)
    compiled = compile_rl(config, "cpu")
    policy = executor.models["policy"]
    policy.optimizer = make_optimizer("adamw", policy.model.parameters(), config.rl_lr)
    add_reference(executor)
    runner = PlanRunner(compiled, executor)
    sampler = arithmetic.PromptSampler(arithmetic.make_splits(seed=0).train, batch_size=config.rl_prompts, seed=1)
    seconds = []
    for _ in range(steps + 3):
        start = time.perf_counter()
        runner.run(arithmetic.to_prompts(sampler.next_batch(), tokenizer))
        seconds.append(time.perf_counter() - start)
    generate = sum(runner.step_seconds.get(step.index, 0.0) for step in compiled.plan.steps
                   if getattr(step, "phase", "") == "generate")
    print(f"median {statistics.median(seconds[3:]) * 1e3:.2f} ms/step  generate {generate / len(seconds) * 1e3:.2f} "
          "ms/step (mean)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 30, int(sys.argv[2]) if len(sys.argv) > 2 else 1)
