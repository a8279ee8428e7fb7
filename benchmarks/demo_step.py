"""The demo's GRPO step alone (32 prompts x 8 samples x 5 tokens, `rlgraph demo`'s prepared run:
its executor and plan, built by `train()`'s wiring, no warm start): the median of STEPS steps
after 3 warm-up ones, and the generate stage's mean. Run it from two worktrees in turn to compare
trees (docs/benchmarks.md, issue 24):

    PYTHONPATH=$PWD .venv/bin/python benchmarks/demo_step.py 30 1      # steps, torch threads
"""

import statistics
import sys
import tempfile
import time

import torch

from rlgraph.data.prompts import to_prompts
from rlgraph.data.sampler import Sampler
from rlgraph.runtime.plan_runner import PlanRunner
from rlgraph.train.demo import DemoConfig, demo_setup
from rlgraph.train.recipe import add_rl_roles, build_roles


def main(steps: int, threads: int) -> None:
    config = DemoConfig(threads=threads, device="cpu")
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as directory:
        setup = demo_setup(config, directory)
    torch.set_num_threads(threads)
    executor = build_roles(setup)  # the policy with its RL optimizer (adamw at rl_lr)
    add_rl_roles(setup, executor)  # the frozen reference the plan reads
    runner = PlanRunner(setup.rl, executor)
    sampler = Sampler(setup.train_rows, config.rl_prompts, seed=1)
    seconds = []
    for _ in range(steps + 3):
        start = time.perf_counter()
        runner.run(to_prompts(sampler.next_batch(), setup.tokenizer))
        seconds.append(time.perf_counter() - start)
    generate = sum(runner.step_seconds.get(step.index, 0.0) for step in setup.rl.plan.steps
                   if getattr(step, "phase", "") == "generate")
    print(f"median {statistics.median(seconds[3:]) * 1e3:.2f} ms/step  generate {generate / len(seconds) * 1e3:.2f} "
          "ms/step (mean)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 30, int(sys.argv[2]) if len(sys.argv) > 2 else 1)
