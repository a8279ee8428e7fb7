"""Do the algorithms learn? The demo (same seed, same SFT warm start, same RL time budget) per algorithm.

    .venv/bin/python benchmarks/algorithms.py                          # grpo, ppo, dapo, 120 s RL each
    .venv/bin/python benchmarks/algorithms.py --algorithms ppo --rl-seconds 60 -p ppo:lam=1.0

Runs one after another (the machine has 2 cores: parallel runs would measure each other), each
through the compiled plan exactly as `rlgraph demo --algorithm <name>`, and prints a Markdown
table: held-out greedy accuracy (200 problems) before and after RL, RL steps, generated rollouts
per second (DAPO's dropped groups included) and rollouts trained on per second. The load average
before each run is printed too, since other work on the machine slows the RL phase and so cuts
the number of steps a time budget buys.
"""

from __future__ import annotations

import argparse
import os
import platform
from datetime import date

from rich.console import Console

from rlgraph.ir.keyvalue import parse_assignment
from rlgraph.train.demo import RL_ALGORITHMS, DemoConfig, DemoResult, run_demo


def _per_algorithm(pairs: list[str]) -> dict[str, dict]:
    """`ppo:lam=1.0` -> {"ppo": {"lam": 1.0}}."""
    out: dict[str, dict] = {}
    for pair in pairs:
        name, sep, setting = pair.partition(":")
        if not sep or name not in RL_ALGORITHMS:
            raise SystemExit(f"algorithms.py: write hyper-parameters as <algorithm>:key=value, got {pair!r}")
        key, value = parse_assignment(setting, f"-p {name}:", "ppo:lam=1.0")
        out.setdefault(name, {})[key] = value
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithms", default="grpo,ppo,dapo")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rl-seconds", type=float, default=120.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--critic-lr", type=float, default=DemoConfig().critic_lr)
    parser.add_argument("-p", "--param", action="append", default=[], help="<algorithm>:key=value")
    args = parser.parse_args()
    hparams = _per_algorithm(args.param)
    console = Console(stderr=True)
    rows: list[tuple[DemoResult, float, dict]] = []
    for name in args.algorithms.split(","):
        load = os.getloadavg()[0]
        config = DemoConfig(algorithm=name, hparams=hparams.get(name, {}), seed=args.seed, rl_seconds=args.rl_seconds,
                            threads=args.threads, critic_lr=args.critic_lr, run_dir=None)
        rows.append((run_demo(config, console), load, hparams.get(name, {})))
    print(f"\n{date.today()}, {platform.machine()} {os.cpu_count()}-core CPU, {args.threads} torch threads, seed {args.seed}, "
          f"{args.rl_seconds:.0f} s RL each, critic lr {args.critic_lr:g} (PPO)\n")
    print("| algorithm | hparams | held-out before RL | after RL | RL steps | generated/s | trained on/s | load before |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for result, load, extra in rows:
        shown = " ".join(f"{k}={v}" for k, v in extra.items()) or "defaults"
        print(f"| {result.algorithm} | {shown} | {result.test_before_rl:.1%} | **{result.test_after_rl:.1%}** | "
              f"{result.rl_steps} | {result.samples_per_second:,.0f} | {result.trained_per_second:,.0f} | {load:.2f} |")


if __name__ == "__main__":
    main()
