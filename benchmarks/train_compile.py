"""The training step's forward + loss + backward, eager against `torch.compile`, alternated in one run.

    .venv/bin/python benchmarks/train_compile.py                    # tiny Qwen2, demo-sized batch
    .venv/bin/python benchmarks/train_compile.py --rows 256 --tokens 16

What is timed is what the update stage runs per micro-batch: the policy's sequence log-probs
(`rlgraph.backends.local.logprobs.sequence_logprobs`: the decoder and the chunked log-prob head),
a PPO-clip loss over them (`rlgraph.functional` math, token mean), and the backward. The compiled
side wraps that whole function in `torch.compile`; its first call (the compile) is reported apart.
Medians over `--rounds` alternated rounds, and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlgraph.backends.local.generation import NativeGenerator, SamplingParams  # noqa: E402
from rlgraph.backends.local.logprobs import sequence_logprobs  # noqa: E402
from rlgraph.backends.local.models import build_causal_lm, load_tokenizer  # noqa: E402
from decode import prompts  # noqa: E402 - benchmarks/decode.py: the same arithmetic prompts


def rollouts(model, tokenizer, rows: int, tokens: int):
    generator = NativeGenerator(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return generator.generate(prompts(tokenizer, rows), 1, SamplingParams(temperature=1.0, max_new_tokens=tokens), seed=0)


def step(model, batch, advantages: torch.Tensor, clip: float = 0.2) -> torch.Tensor:
    lp = sequence_logprobs(model, batch, temperature=1.0, with_entropy=False)  # [N, T]
    ratio = torch.exp(lp - batch.logprobs)  # [N, T]
    surrogate = torch.minimum(ratio * advantages[:, None], ratio.clamp(1 - clip, 1 + clip) * advantages[:, None])
    mask = batch.mask.float()  # [N, T]
    loss = -(surrogate * mask).sum() / mask.sum()
    loss.backward()
    return loss.detach()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--tokens", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    tokenizer, model = load_tokenizer(None), build_causal_lm(None)
    compiled = torch.compile(step)
    print("| rows | tokens | eager ms | compiled ms | ratio | compile s | loss difference |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for rows in args.rows:
        batch = rollouts(model, tokenizer, rows, args.tokens)
        advantages = torch.randn(rows, generator=torch.Generator().manual_seed(rows))  # [N]
        model.train()
        start = time.perf_counter()
        compiled(model, batch, advantages)
        compile_s = time.perf_counter() - start
        times = {"eager": [], "compiled": []}
        losses = {}
        for _ in range(args.rounds):
            for name, fn in (("eager", step), ("compiled", compiled)):
                model.zero_grad(set_to_none=True)
                begin = time.perf_counter()
                losses[name] = float(fn(model, batch, advantages))
                times[name].append(time.perf_counter() - begin)
        e, c = statistics.median(times["eager"]), statistics.median(times["compiled"])
        print(f"| {rows} | {batch.response_ids.shape[1]} | {e * 1e3:.1f} | {c * 1e3:.1f} | {e / c:.2f}x | "
              f"{compile_s:.1f} | {abs(losses['eager'] - losses['compiled']):.1e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
