"""The reference forward compiled or eager, inside `rlgraph bench`'s GRPO step, alternated in one run.

    TORCHINDUCTOR_CACHE_DIR=/tmp/ind .venv/bin/python benchmarks/reference_compile.py --config small

Two `rlgraph.bench.RlgraphSide`s with the decode step and the training forward compiled
(`generation.compile=on`, `train.compile=on`): "after" as `LocalExecutor` runs it now, the
reference's log-probs (`rg.logprobs`, no gradients) through the compiled forward too; "before"
runs its inference forwards eager, as it did until 2026-11-28. Both train on the same prompts in
the same order; after `--warmup` steps each (the compiles), rounds of `--per-round` steps per
side, the first side alternating. Prints each side's median step and its mean seconds a step by
plan stage (`infer` is the reference forward).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlgraph.backends.local.executor import LocalExecutor  # noqa: E402
from rlgraph.bench import CONFIGS, RlgraphSide, bench_problems, write_model  # noqa: E402


class EagerInference(LocalExecutor):
    """The executor as before: the update's forward compiled, the inference forwards eager."""

    def _inference(self, *args, **kwargs):
        self.compile_train = False
        try:
            return super()._inference(*args, **kwargs)
        finally:
            self.compile_train = True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="small")
    parser.add_argument("--steps", type=int, default=60, help="measured steps per side")
    parser.add_argument("--per-round", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = CONFIGS[args.config]
    rounds = -(-args.steps // args.per_round)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(config, Path(tmp) / "model")
        problems = bench_problems(config, (rounds * args.per_round + args.warmup) * config.prompts)
        sides = {name: RlgraphSide(config, model_dir, problems, decode_compile="on", compile_train=True)
                 for name in ("before", "after")}
        sides["before"].executor.__class__ = EagerInference
        for name, side in sides.items():
            start = time.perf_counter()
            for _ in range(args.warmup):
                side.step()
            print(f"{name}: warm-up {time.perf_counter() - start:.1f} s (the compiles)", flush=True)
            side.mark_warm()
        for k in range(rounds):
            for name in (("before", "after") if k % 2 == 0 else ("after", "before")):
                for _ in range(args.per_round):
                    sides[name].step()
        for name, side in sides.items():
            stages = side.stages_per_step(rounds * args.per_round)
            shown = ", ".join(f"{kind} {seconds * 1e3:.2f}" for kind, seconds in stages.items() if seconds > 2e-4)
            print(f"{name}: median {statistics.median(side.seconds[args.warmup:]) * 1e3:.2f} ms a step; "
                  f"ms a step by stage: {shown}")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
