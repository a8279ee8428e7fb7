"""Async multi-turn RL: staleness 1 against 0 on the calculator agent, split spmd, 2 ranks, with a
slow tool and without, the four configurations alternated in one run.

    .venv/bin/python benchmarks/async_multiturn.py [--rounds 2] [--steps 4] [--prompts 4] [--n 8] [--delay-ms 50]

First one warm start (the example's SFT on tool-use traces, `examples/calculator_agent/config.yaml`,
a fixed `--warm-steps` 150, about where its 30% held-out
target stops it, then one RL step so that the run writes a checkpoint),
exported once to OUT/warm with `rlgraph export`: every measured run starts from that directory, so
the policy calls the calculator from its first step (`env/tool_calls` per episode is reported).
Then, per round, the four configurations (staleness 0/1 x tool delay 0/`--delay-ms`) each as one
`rlgraph train` run on `--runtime spmd --nproc 2` with `split:policy=1,rollout=1` (rank 0 trains,
rank 1 runs the episodes, environment steps included). Each run takes `--steps` + 1 RL steps;
the first is not timed (with staleness 1 it also generates the batch ahead), nor are process
start-up and the held-out evaluations before and after. Reported per configuration (medians
over rounds): samples/s (episodes trained per second), seconds per step, tool calls per episode,
turns per episode, the lag of the batches trained; then the ratios staleness 1 / staleness 0.

The slow tool is this file's `SlowCalculator` environment (`env.path`): the built-in calculator
inside a ToolEnv, each call first sleeping `delay_ms` (wall time, no CPU: a remote API or a
sandbox round trip). Without the delay the same class runs with `delay_ms: 0`, so both sides run
the same code. Environment steps of one turn run concurrently on the generating rank (a pool of
16 threads, `rlgraph/agents/episode.py`), so a turn whose rows all call costs about
`ceil(rows / 16) x delay_ms` there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import attrs
import yaml

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "calculator_agent" / "config.yaml"
sys.path.insert(0, str(ROOT))

from rlgraph.agents.tool_env import ScoreAnswer, ToolEnv  # noqa: E402
from rlgraph.agents.tools import calculator  # noqa: E402
from rlgraph.rewards import build_reward  # noqa: E402


@attrs.frozen
class _Sleeping:
    """A tool function that waits `delay_ms` before answering (picklable: env workers rebuild it)."""

    fn: object
    delay_ms: float

    def __call__(self, **arguments):
        time.sleep(self.delay_ms / 1e3)
        return self.fn(**arguments)


class SlowCalculator(ToolEnv):
    """The example's environment (the calculator, plain call format, answers scored by the `math`
    reward) with every tool call `delay_ms` slower."""

    def __init__(self, delay_ms: float = 50.0) -> None:
        tool = calculator()
        slow = attrs.evolve(tool, fn=_Sleeping(tool.fn, float(delay_ms))) if delay_ms else tool
        super().__init__([slow], format="plain", reward=ScoreAnswer(build_reward("math")))


def base_config() -> dict:
    """The example's config with absolute data/model paths, quiet logging, no periodic checkpoints."""
    raw = yaml.safe_load(EXAMPLE.read_text())
    for section, key in (("model", "path"), ("model", "tokenizer"), ("data", "train"), ("data", "eval")):
        raw[section][key] = str(ROOT / raw[section][key])
    raw["logging"] = {"tensorboard": False, "plots": False, "progress": False, "samples": 0}
    raw["checkpoint"] = {"every": 10**6, "keep_last": 1}
    return raw


def warm_start(out: Path, threads: int, steps: int) -> Path:
    """The example's warm start (local runtime), `steps` SFT steps without its held-out checks (on the
    loaded machine they took most of its ~30 min), and one RL step, exported to OUT/warm; reused if there."""
    from rlgraph.train.config import load_config
    from rlgraph.train.export import export_run
    from rlgraph.train.run import train

    model = out / "warm"
    if (model / "config.json").is_file():
        print(f"warm start: reusing {model}")
        return model
    raw = base_config()
    raw["warm_start"].update(steps=steps, target_accuracy=None)
    raw.update(run_dir=str(out / "warm_run"), train={"steps": 1, "seed": 0}, eval={"every": 0, "max_prompts": 50},
               runtime={"threads": threads})
    start = time.perf_counter()
    train(load_config(base=raw))
    export_run(out / "warm_run", model)
    print(f"warm start and one RL step: {time.perf_counter() - start:.0f} s, exported to {model}")
    return model


def measured_config(out: Path, model: Path, name: str, staleness: int, delay_ms: float, args) -> dict:
    raw = base_config()
    raw["model"] = {"path": str(model), "tokenizer": str(model)}
    raw["env"] = {"path": f"{Path(__file__).resolve()}:SlowCalculator", "options": {"delay_ms": delay_ms}}
    raw["warm_start"] = {"steps": 0}
    raw["rollout"].update(prompts_per_step=args.prompts, n=args.n, staleness=staleness)
    raw.update(run_dir=str(out / name), train={"steps": args.steps + 1, "seed": 0},
               eval={"every": 0, "max_prompts": args.eval_prompts},
               runtime={"runtime": "spmd", "nproc": 2, "placement": "split:policy=1,rollout=1", "threads": 1})
    return raw


def measure(raw: dict) -> dict[str, float]:
    """One run; the timed steps' samples/s, s/step, tool calls and turns per episode, lag."""
    from rlgraph.train.config import load_config
    from rlgraph.train.run import train

    train(load_config(base=raw))
    rows = [json.loads(line) for line in (Path(raw["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "time/step_s" in row][1:]  # the first step is not timed
    seconds = sum(row["time/step_s"] for row in steps)
    episodes = raw["rollout"]["prompts_per_step"] * raw["rollout"]["n"]
    mean = lambda key: statistics.fmean(row.get(key, 0.0) for row in steps)  # noqa: E731
    return {"samples/s": len(steps) * episodes / seconds, "s/step": seconds / len(steps),
            "tool calls": mean("env/tool_calls"), "turns": mean("env/turns"), "lag": mean("rollout/staleness"),
            "reward": mean("reward")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_async_multiturn")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="timed RL steps per run (one more is run first)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--n", type=int, default=8, help="episodes per prompt")
    parser.add_argument("--delay-ms", type=float, default=50.0, help="the slow tool's wait per call")
    parser.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts of each run's (untimed) evaluations")
    parser.add_argument("--warm-steps", type=int, default=150, help="SFT steps of the warm start (the example's stops "
                        "at its 30%% target after ~150)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the warm start")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    model = warm_start(args.out, args.threads, args.warm_steps)
    sides = [(staleness, delay) for delay in (0.0, args.delay_ms) for staleness in (0, 1)]
    results: dict[tuple[int, float], list[dict[str, float]]] = {side: [] for side in sides}
    stamp = time.strftime("%H%M%S")
    for round_ in range(args.rounds):
        order = sides if round_ % 2 == 0 else sides[::-1]  # alternate which side goes first
        for staleness, delay in order:
            name = f"{stamp}_r{round_}_s{staleness}_d{delay:g}"
            got = measure(measured_config(args.out, model, name, staleness, delay, args))
            results[(staleness, delay)].append(got)
            print(f"round {round_ + 1} staleness {staleness} tool delay {delay:g} ms: "
                  + ", ".join(f"{key} {value:.3g}" for key, value in got.items()), flush=True)
    print(f"\nmedians over {args.rounds} rounds x {args.steps} timed steps, {args.prompts} prompts x n={args.n} "
          "episodes a step, split spmd (rank 0 trains, rank 1 runs the episodes):")
    median = {side: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for side, runs in results.items()}
    for (staleness, delay), values in median.items():
        print(f"  staleness {staleness}, tool delay {delay:>3g} ms: "
              + ", ".join(f"{key} {value:.3g}" for key, value in values.items()))
    for delay in (0.0, args.delay_ms):
        per_round = [fast["samples/s"] / slow["samples/s"] for fast, slow in zip(results[(1, delay)], results[(0, delay)])]
        print(f"  ratio staleness 1 / 0, tool delay {delay:g} ms: {median[(1, delay)]['samples/s'] / median[(0, delay)]['samples/s']:.2f}x "
              f"(per round: {', '.join(f'{r:.2f}' for r in per_round)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
