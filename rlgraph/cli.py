"""The `rlgraph` command line: `rlgraph demo`, `rlgraph trace <algorithm>`."""

from __future__ import annotations

import argparse
import ast
import sys
from typing import Any


def _hparams(pairs: list[str]) -> dict[str, Any]:
    values = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep:
            raise SystemExit(f"rlgraph: hyper-parameter {pair!r} must be written key=value")
        try:
            values[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            values[key] = raw
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlgraph", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="SFT then GRPO on the arithmetic task, on CPU")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--rl-seconds", type=float, default=120.0)
    demo.add_argument("--run-dir", default="runs/demo")

    trace = sub.add_parser("trace", help="print an algorithm's typed program")
    trace.add_argument("algorithm")
    trace.add_argument("-p", "--param", action="append", default=[], help="hyper-parameter key=value")
    trace.add_argument("--source", action="store_true", help="show the source line of every value")

    args = parser.parse_args(argv)
    if args.command == "demo":
        from rlgraph.train.demo import DemoConfig, run_demo

        run_demo(DemoConfig(seed=args.seed, rl_seconds=args.rl_seconds, run_dir=args.run_dir))
        return 0
    if args.command == "trace":
        from rlgraph.algorithms import ALGORITHMS

        if args.algorithm not in ALGORITHMS:
            raise SystemExit(f"rlgraph: unknown algorithm {args.algorithm!r}; known: {', '.join(sorted(ALGORITHMS))}")
        print(ALGORITHMS[args.algorithm].trace(**_hparams(args.param)).pretty(source=args.source))
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
