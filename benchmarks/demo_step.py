"""The demo's GRPO step alone (32 prompts x 8 samples x 5 tokens): `rlgraph demo`'s configuration
opened as a `rlgraph.train.run.Run` (the wiring `train()` runs, nothing built by hand) without its
warm start, stepped STEPS + 3 times: the median step after 3 warm-up ones, and the generate stage's
mean (`time/generate_s`, the name `rlgraph train` logs). Run it from two worktrees in turn to compare
trees (docs/benchmarks.md, issue 24):

    PYTHONPATH=$PWD .venv/bin/python benchmarks/demo_step.py 30 1      # steps, torch threads
"""

import statistics
import sys
import tempfile
from pathlib import Path

import torch
from rich.console import Console

from rlgraph.plan.timing import STEP_SECONDS, stage_metric
from rlgraph.train.demo import DemoConfig, demo_config, write_data
from rlgraph.train.run import Run


def main(steps: int, threads: int) -> None:
    demo = DemoConfig(threads=threads, device="cpu", rl_max_steps=steps + 3)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        config = demo_config(demo, root / "run", write_data(root / "data", demo.seed))
        config = config.model_copy(update={"warm_start": config.warm_start.model_copy(update={"steps": 0}),
                                           "logging": config.logging.model_copy(update={"progress": False})})
        with Run(config, console=Console(quiet=True)) as run:
            torch.set_num_threads(threads)
            metrics = [run.step() for _ in range(steps + 3)]
    seconds = [row[STEP_SECONDS] for row in metrics]
    generate = statistics.mean(row[stage_metric("generate")] for row in metrics)
    print(f"median {statistics.median(seconds[3:]) * 1e3:.2f} ms/step  generate {generate * 1e3:.2f} ms/step (mean)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 30, int(sys.argv[2]) if len(sys.argv) > 2 else 1)
