"""Multi-turn rollouts: throughput against single-turn generation at equal total tokens, and the
environment's overhead per step.

    .venv/bin/python benchmarks/agents.py                       # tiny Qwen2, 32 rows, 24 tokens, 3 turns
    .venv/bin/python benchmarks/agents.py --rows 64 --tokens 48 --turns 4 --threads 2

Single-turn: `LocalExecutor.generate` of `tokens` new tokens (no EOS: the tiny model is random, so
EOS is masked out to keep the length fixed). Multi-turn: `LocalExecutor.rollout` with an environment
that answers every turn with a fixed observation, `turns` turns of (tokens - observations) / turns
policy tokens, the same `tokens` response columns in all. Tokens/s counts every response token
that went through the model (policy + observation). KV cache against re-prefill: the same rollout
with a decoder that feeds each row's whole conversation again at every turn (what the cache saves;
the tokens each path fed to the model are counted). Env overhead: `agents.episode.step_all` over
`rows` no-op environments, per env step, in this process and in `--env-workers` worker processes
(`rlgraph.agents.workers`: one batched round trip per worker per turn). Medians over `--rounds`
alternated rounds.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rlgraph as rg  # noqa: E402
from rlgraph.agents import episode as E  # noqa: E402
from rlgraph.agents.workers import EnvWorkers  # noqa: E402
from rlgraph.backends.local import multiturn  # noqa: E402
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


class RePrefill(multiturn.TurnDecoder):
    """The baseline the KV cache saves: a block after the first (the last sampled token and an
    observation) re-feeds each row's whole conversation through a fresh cache; decode steps stay
    incremental."""

    def __init__(self, model):
        super().__init__(model)
        self.history = None

    def feed(self, ids, mask):
        rows = [ids[r][mask[r]].tolist() for r in range(ids.shape[0])]
        first, self.history = self.history is None, rows if self.history is None else [
            old + new for old, new in zip(self.history, rows)]
        if first or ids.shape[1] == 1:
            return super().feed(ids, mask)
        fresh = multiturn.TurnDecoder(self.model)
        self.logits = fresh.feed(*multiturn.left_pad(self.history, 0, ids.device))
        self.cache, self.attention, self.positions = fresh.cache, fresh.attention, fresh.positions
        self.fed_tokens += fresh.fed_tokens
        return self.logits

    def keep(self, rows):
        super().keep(rows)
        self.history = [self.history[row] for row in rows.tolist()]


def fed_tokens(decoder_type, run):
    """`run()` with `decoder_type` as the multi-turn decoder; (seconds, CPU seconds of this process,
    tokens fed to the model). CPU time is what a loaded machine distorts least: waiting for a core
    is not counted."""
    made = []

    def make(model):
        made.append(decoder_type(model))
        return made[-1]

    original, multiturn.TurnDecoder = multiturn.TurnDecoder, make
    cpu = time.process_time()
    try:
        seconds, _ = timed(run)
    finally:
        multiturn.TurnDecoder = original
    return seconds, time.process_time() - cpu, sum(decoder.fed_tokens for decoder in made)


def env_step_seconds(rows: int, rounds: int, tokenizer, workers: int | None) -> list[float]:
    """Seconds per env step of `step_all` over `rows` no-op token envs, here or in `workers` processes."""
    # The workers rebuild the env class by reference: this file imported as a module (its folder is on sys.path).
    env_type = importlib.import_module(Path(__file__).stem).Noop
    host = EnvWorkers(env_type, workers) if workers else None
    envs = host.environments(rows, tokenizer) if host else [env_type() for _ in range(rows)]
    try:
        episodes = E.start(envs, [{}] * rows, 10**6, vocab=47, timeout_s=30.0)
        E.step_all(episodes, [[4]] * rows, turn=0, timeout_s=30.0, vocab=47)  # warm
        return [timed(lambda: E.step_all(episodes, [[4]] * rows, turn=0, timeout_s=30.0, vocab=47))[0] / rows
                for _ in range(rounds)]
    finally:
        if host:
            host.close()


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
    parser.add_argument("--env-workers", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    executor = tiny_executor(max_new_tokens=args.tokens)
    no_eos(executor)
    executor.envs["env"] = Fixed
    prompts, policy = tiny_prompts(args.rows), executor.current("policy")
    per_turn = (args.tokens - (args.turns - 1) * len(OBSERVATION)) // args.turns
    single, multi, cached, reprefilled = [], [], [], []
    for _ in range(args.rounds):
        seconds, ro = timed(lambda: executor.generate(policy, prompts, n=1, max_new_tokens=args.tokens))
        single.append(int(ro.mask.sum()) / seconds)
        seconds, (ro, _, _) = timed(lambda: executor.rollout(policy, EnvRef("env"), prompts, n=1, max_turns=args.turns,
                                                            max_tokens_per_turn=per_turn, max_total_tokens=args.tokens))
        multi.append(int(ro.context_mask.sum()) / seconds)
        roll = lambda: executor.rollout(policy, EnvRef("env"), prompts, n=1, max_turns=args.turns,  # noqa: E731
                                        max_tokens_per_turn=per_turn, max_total_tokens=args.tokens)
        cached.append(fed_tokens(multiturn.TurnDecoder, roll))
        reprefilled.append(fed_tokens(RePrefill, roll))
    here = env_step_seconds(args.rows, args.rounds * 4, executor.tokenizer, None)
    away = env_step_seconds(args.rows, args.rounds * 4, executor.tokenizer, args.env_workers)
    print(f"rows={args.rows} tokens={args.tokens} turns={args.turns} (per turn {per_turn}) threads={args.threads}")
    print(f"single-turn generate   {statistics.median(single):8.0f} tokens/s")
    print(f"multi-turn rollout     {statistics.median(multi):8.0f} tokens/s   "
          f"({statistics.median(multi) / statistics.median(single):.2f}x)")
    (cache_s, cache_cpu), cache_fed = (statistics.median(x[k] for x in cached) for k in (0, 1)), cached[0][2]
    (again_s, again_cpu), again_fed = (statistics.median(x[k] for x in reprefilled) for k in (0, 1)), reprefilled[0][2]
    print(f"rollout, KV cache kept {cache_s:8.3f} s ({cache_cpu:.3f} CPU s), {cache_fed} tokens fed")
    print(f"rollout, re-prefill    {again_s:8.3f} s ({again_cpu:.3f} CPU s), {again_fed} tokens fed   "
          f"(cache: {again_s / cache_s:.2f}x wall, {again_cpu / cache_cpu:.2f}x CPU, {again_fed / cache_fed:.2f}x fewer tokens)")
    print(f"env overhead per step  {1e6 * statistics.median(here):8.1f} us in this process (no-op env, thread pool, checks)")
    print(f"env overhead per step  {1e6 * statistics.median(away):8.1f} us in {args.env_workers} env worker processes "
          f"({statistics.median(away) / statistics.median(here):.1f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
