"""The `rlgraph` command line: `rlgraph demo [--algorithm ppo]`, `rlgraph trace <algorithm>`, `rlgraph plan <algorithm>`."""

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

    demo = sub.add_parser("demo", help="SFT then RL (GRPO by default) on the arithmetic task, on CPU")
    demo.add_argument("--algorithm", default="grpo", help="the RL algorithm: grpo, ppo, dapo, rloo, ... (rlgraph.algorithms)")
    demo.add_argument("-p", "--param", action="append", default=[], help="RL hyper-parameter key=value, e.g. lam=1.0")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--rl-seconds", type=float, default=120.0)
    demo.add_argument("--rl-lr", type=float, default=1e-4)
    demo.add_argument("--critic-lr", type=float, default=1e-4, help="PPO's critic")
    demo.add_argument("--run-dir", default="runs/demo")

    trace = sub.add_parser("trace", help="print an algorithm's typed program")
    trace.add_argument("algorithm")
    trace.add_argument("-p", "--param", action="append", default=[], help="hyper-parameter key=value")
    trace.add_argument("--source", action="store_true", help="show the source line of every value")

    plan = sub.add_parser("plan", help="compile an algorithm and print its placement plan (runs nothing)")
    plan.add_argument("algorithm")
    plan.add_argument("--mesh", default="gpu:8", help="e.g. gpu:8, h200:8, 2x8:h100, cpu:2")
    plan.add_argument("--placement", default="colocated",
                      help="colocated | colocated:fsdp=8,tp=2 | split:policy=4,rollout=4[,ref=policy]")
    plan.add_argument("--model", default="tiny-qwen2", help="a preset (e.g. llama3-70b) or a config.json / model directory")
    plan.add_argument("--sizes", default="B=32,P=64,T=256", help="concrete dims, e.g. B=64,P=512,T=1024")
    plan.add_argument("-p", "--param", action="append", default=[], help="hyper-parameter key=value")
    plan.add_argument("--dot", help="write the Graphviz diagram here (.dot; .svg/.png rendered if Graphviz is installed)")
    plan.add_argument("--json", help="write the plan as JSON here")

    args = parser.parse_args(argv)
    if args.command == "demo":
        from rlgraph.train.demo import RL_ALGORITHMS, DemoConfig, run_demo

        if args.algorithm not in RL_ALGORITHMS:
            raise SystemExit(f"rlgraph: unknown RL algorithm {args.algorithm!r}; known: {', '.join(RL_ALGORITHMS)}")
        run_demo(DemoConfig(algorithm=args.algorithm, hparams=_hparams(args.param), seed=args.seed, rl_seconds=args.rl_seconds,
                            rl_lr=args.rl_lr, critic_lr=args.critic_lr, run_dir=args.run_dir))
        return 0
    if args.command == "plan":
        return _plan(args)
    if args.command == "trace":
        from rlgraph.algorithms import ALGORITHMS

        if args.algorithm not in ALGORITHMS:
            raise SystemExit(f"rlgraph: unknown algorithm {args.algorithm!r}; known: {', '.join(sorted(ALGORITHMS))}")
        print(ALGORITHMS[args.algorithm].trace(**_hparams(args.param)).pretty(source=args.source))
        return 0
    return 2


def parse_placement(text: str):
    """`colocated`, `colocated:fsdp=8,tp=2,offload=False`, `split:policy=4,rollout=4,ref=policy`."""
    from rlgraph.plan.mesh import colocated, split

    kind, _, rest = text.partition(":")
    fields = _hparams([item for item in rest.split(",") if item])
    if kind == "colocated":
        return colocated(**fields)
    if kind == "split":
        tp = fields.pop("tp", 1)
        return split(fields, tp=tp)
    raise SystemExit(f"rlgraph: unknown placement {text!r}; use colocated[:fsdp=..,tp=..] or split:role=ranks,...")


def _plan(args) -> int:
    import rlgraph as rg
    from rlgraph.algorithms import ALGORITHMS
    from rlgraph.ir.errors import RLGraphError
    from rlgraph.plan.dot import render

    if args.algorithm not in ALGORITHMS:
        raise SystemExit(f"rlgraph: unknown algorithm {args.algorithm!r}; known: {', '.join(sorted(ALGORITHMS))}")
    sizes = {key: int(value) for key, value in _hparams(args.sizes.split(",")).items()}
    hparams = _hparams(args.param)
    sizes.setdefault("n", hparams.get("n", 8))
    try:
        compiled = rg.compile(ALGORITHMS[args.algorithm], mesh=args.mesh, placement=parse_placement(args.placement),
                              sizes=sizes, models={"policy": args.model}, **hparams)
    except (RLGraphError, ValueError) as exc:
        print(f"rlgraph plan: {exc}", file=sys.stderr)
        return 1
    print(compiled.as_text())
    if args.dot:
        dot = compiled.to_dot()
        base = args.dot.rsplit(".", 1)[0]
        with open(base + ".dot", "w") as handle:
            handle.write(dot)
        rendered = render(dot, args.dot) if not args.dot.endswith(".dot") else None
        print(f"diagram: {base}.dot" + (f", {rendered}" if rendered else ""))
    if args.json:
        with open(args.json, "w") as handle:
            handle.write(compiled.plan.to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
