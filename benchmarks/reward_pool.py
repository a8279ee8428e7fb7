"""Reward pool overhead: one batch scored in the controller against the same batch in reward workers.

    .venv/bin/python benchmarks/reward_pool.py                  # the demo's batch: 32 prompts x 8
    .venv/bin/python benchmarks/reward_pool.py --rows 64 --rounds 100 --workers 1 2

The demo's reward (`exact_match`) and the math reward on the same completions, alternated round
by round (in the controller, then each pool), medians in ms per batch; the pool's start (spawn to
the first answer, each worker importing torch and the rewards) is reported apart.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlgraph.rewards import RewardPipeline, RewardTerm, exact_match, math_reward  # noqa: E402


def batch(rows: int) -> tuple[list[str], dict]:
    """Completions of "a+b=" prompts, a third right, a third boxed, a third wrong (the demo's shape)."""
    answers = [str(i % 100 + (7 * i) % 100) for i in range(rows)]
    completions = [a if i % 3 == 0 else f"\\boxed{{{a}}}" if i % 3 == 1 else "12x" for i, a in enumerate(answers)]
    return completions, {"answer": answers, "text": [f"{i % 100}+{(7 * i) % 100}=" for i in range(rows)]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args(argv)
    completions, meta = batch(args.rows)
    for name, fn in (("exact_match", exact_match), ("math", math_reward)):
        terms = [RewardTerm(name, fn)]
        pipelines = {"controller": RewardPipeline(terms, timeout_s=600)}
        for workers in args.workers:
            pool = RewardPipeline(terms, timeout_s=600, workers=workers)
            start = time.perf_counter()
            pool(completions, **meta)
            print(f"{name}: pool of {workers} started in {time.perf_counter() - start:.2f} s")
            pipelines[f"{workers} worker(s)"] = pool
        times: dict[str, list[float]] = {key: [] for key in pipelines}
        expected = pipelines["controller"](completions, **meta)
        for _ in range(args.rounds):
            for key, pipeline in pipelines.items():
                start = time.perf_counter()
                scores = pipeline(completions, **meta)
                times[key].append((time.perf_counter() - start) * 1e3)
                assert scores == expected, key  # the same floats wherever they are computed
        base = statistics.median(times["controller"])
        for key, values in times.items():
            median = statistics.median(values)
            print(f"{name} ({args.rows} rows): {key:12s} {median:7.2f} ms/batch  (+{median - base:.2f} ms)")
        for pipeline in pipelines.values():
            pipeline.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
