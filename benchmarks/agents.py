"""Multi-turn rollouts: throughput against single-turn generation at equal total tokens, and the
environment's overhead per step.

    .venv/bin/python benchmarks/agents.py                       # tiny Qwen2, 32 rows, 24 tokens, 3 turns
    .venv/bin/python benchmarks/agents.py --rows 64 --tokens 48 --turns 4 --threads 2

Single-turn: `LocalExecutor.generate` of `tokens` new tokens (no EOS: the tiny model is random, so
EOS is masked out to keep the length fixed). Multi-turn: `LocalExecutor.rollout` with an environment
that answers every turn with a fixed observation, `turns` turns of (tokens - observations) / turns
policy tokens, the same `tokens` response columns in all. Tokens/s counts every response token
that went through the model (policy + observation). Env overhead: `agents.episode.step_all` over
`rows` no-op environments, per env step. Medians over `--rounds` alternated rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rlgraph as rg  # noqa: E402
from rlgraph.agents import episode as E  # noqa: E402
from rlgraph.backends.protocols import EnvRef  # noqa: E402
from rlgraph.testing.tiny import tiny_executor, tiny_prompts  # noqa: E402

OBSERVATION = "7+7"  # 3 tokens, plus the two newlines the char tokenizer drops


class Fixed:
    """Answers every turn with the same short observation; never done (the turn budget ends it)."""

    def reset(self, row):
        return None

    def step(self, action_text):
        return rg.Step(OBSERVATION, 0.0, False)


class Noop:
    def initial_observation(self, row):
        return []

    def step(self, action_tokens):
        return rg.Step([], 0.0, False)


def no_eos(executor):
    """The policy's EOS logit at -inf: every turn runs to its cap, so both paths decode the same tokens."""
    head = executor.models["policy"].model.lm_head
    head.register_forward_hook(lambda module, args, out: out.index_fill(-1, torch.tensor([2]), float("-inf")))


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    executor = tiny_executor(max_new_tokens=args.tokens)
    no_eos(executor)
    executor.envs["env"] = Fixed
    prompts, policy = tiny_prompts(args.rows), executor.current("policy")
    per_turn = (args.tokens - (args.turns - 1) * len(OBSERVATION)) // args.turns
    single, multi = [], []
    for _ in range(args.rounds):
        seconds, ro = timed(lambda: executor.generate(policy, prompts, n=1, max_new_tokens=args.tokens))
        single.append(int(ro.mask.sum()) / seconds)
        seconds, (ro, _, _) = timed(lambda: executor.rollout(policy, EnvRef("env"), prompts, n=1, max_turns=args.turns,
                                                            max_tokens_per_turn=per_turn, max_total_tokens=args.tokens))
        multi.append(int(ro.context_mask.sum()) / seconds)
    episodes = [E.Episode(Noop(), row, 10**6) for row in range(args.rows)]
    overhead = [timed(lambda: E.step_all(episodes, [[4]] * args.rows, turn=0, timeout_s=30.0, vocab=47))[0] / args.rows
                for _ in range(args.rounds * 4)]
    print(f"rows={args.rows} tokens={args.tokens} turns={args.turns} (per turn {per_turn}) threads={args.threads}")
    print(f"single-turn generate   {statistics.median(single):8.0f} tokens/s")
    print(f"multi-turn rollout     {statistics.median(multi):8.0f} tokens/s   "
          f"({statistics.median(multi) / statistics.median(single):.2f}x)")
    print(f"env overhead per step  {1e6 * statistics.median(overhead):8.1f} us (no-op env, thread pool, checks)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
