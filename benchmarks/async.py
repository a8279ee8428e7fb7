"""Asynchronous RL on spmd: staleness 1 against 0, 2 ranks, split placement, alternated in one run.

    .venv/bin/python benchmarks/async.py [--rounds 3] [--steps 6] [--rows 16] [--n 4] [--tokens 8] [--epochs 2]
    .venv/bin/python benchmarks/async.py --device cuda      # NCCL between the two GPUs (untested here)

Rank 0 trains the policy (FSDP2 on one rank), rank 1 generates (the native engine); with
staleness 0 each waits for the other, with staleness 1 rank 1 generates batch i+1 while rank 0
trains batch i (and the controller scores batch i+1). The configuration (tiny Qwen2, GRPO, AdamW 1e-4) is sized so that generation and
training take similar time (`--epochs` sets the training side; the script prints both lanes'
busy time per step so you can check). Each round starts a fresh runner of each plan on the same
two workers (staleness 0, then 1) and times `--steps` steps after the first (which for staleness
1 also generates the batch ahead); reported: samples/s (trained rows per second) of each, medians
over rounds, and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import rlgraph as rg
from rlgraph.algorithms import ALGORITHMS
from rlgraph.backends.world import RoleSpec, WorldSpec
from rlgraph.runtime.plan_runner import PlanRunner
from rlgraph.runtime.spmd import SpmdTransport, resolve_device
from rlgraph.testing.tiny import length_parity_reward, tiny_prompts


def _reward(wait_ms: float):
    """The tiny length-parity reward, waiting `wait_ms` per call first (a sleep: wall time, no CPU)."""
    if not wait_ms:
        return length_parity_reward

    def waiting_reward(completions, **fields):
        time.sleep(wait_ms / 1e3)
        return length_parity_reward(completions, **fields)

    return waiting_reward


def _compile(args, staleness: int):
    return rg.compile(ALGORITHMS["grpo"], mesh=f"{'cpu' if args.device == 'cpu' else 'gpu'}:2",
                      placement=rg.split({"policy": 1, "rollout": 1}, checkpointing=False), sizes={"B": args.rows, "P": 8, "T": args.tokens},
                      n=args.n, max_new_tokens=args.tokens, epochs=args.epochs, staleness=staleness, engine="native")


def _round(compiled, transport, world, args) -> tuple[float, dict[int, float]]:
    """Samples/s over `args.steps` steps after the first, and each rank's busy seconds per step."""
    runner = PlanRunner(compiled, transport, controller=world.controller())
    drawn = iter(range(1, 10_000))

    def more():
        return tiny_prompts(args.rows, (args.rows * next(drawn)) % 4096)

    runner.run(tiny_prompts(args.rows), more_prompts=more)  # the first step (and the batch ahead)
    busy = list(transport.busy_s)
    start = time.perf_counter()
    for _ in range(args.steps):
        runner.run(more(), more_prompts=more)
    seconds = time.perf_counter() - start
    per_rank = {rank: (after - before) / args.steps for rank, (before, after) in enumerate(zip(busy, transport.busy_s))}
    return args.steps * args.rows * args.n / seconds, per_rank


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rows", type=int, default=16, help="prompts per step (B)")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--tokens", type=int, default=8, help="new tokens per sample (T)")
    parser.add_argument("--epochs", type=int, default=2, help="update epochs: the training side's work")
    parser.add_argument("--reward-ms", type=float, default=0.0,
                        help="each reward call also waits this long, using no CPU (a sandboxed code reward, a remote "
                             "reward model); on a loaded machine this shows the overlap that CPU contention hides")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    args = parser.parse_args(argv)
    args.device = resolve_device(args.device)
    world = WorldSpec({"policy": RoleSpec(optimizer="adamw", lr=1e-4)}, {"reward": _reward(args.reward_ms)},
                      max_new_tokens=args.tokens)
    plans = {staleness: _compile(args, staleness) for staleness in (0, 1)}
    print(plans[1].as_text().split("async:")[1].strip().splitlines()[-1].strip())  # the plan's own estimate
    rates: dict[int, list[float]] = {0: [], 1: []}
    with SpmdTransport(plans[0].plan, world, device=args.device, threads_per_worker=1) as transport:
        for round_ in range(args.rounds):
            for staleness, compiled in plans.items():
                rate, busy = _round(compiled, transport, world, args)
                rates[staleness].append(rate)
                shown = ", ".join(f"rank {rank} busy {1e3 * seconds:.0f} ms/step" for rank, seconds in busy.items())
                print(f"round {round_ + 1} staleness {staleness}: {rate:.1f} samples/s ({shown})")
    sync, ahead = statistics.median(rates[0]), statistics.median(rates[1])
    print(f"median samples/s: staleness 0 {sync:.1f}, staleness 1 {ahead:.1f}, ratio {ahead / sync:.2f}x "
          f"({args.rounds} rounds x {args.steps} steps, B={args.rows} n={args.n} T={args.tokens} epochs={args.epochs}, "
          f"reward wait {args.reward_ms:g} ms, {args.device})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
