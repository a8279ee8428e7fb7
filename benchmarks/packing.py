"""Packed sequences against padded rows: FLOPs saved and the update's step time, alternated in one run.

    .venv/bin/python benchmarks/packing.py                      # both length spreads, tiny Qwen2
    .venv/bin/python benchmarks/packing.py --spread math --rounds 9

Two length spreads, prompts from examples/math_grpo/train.jsonl (the math example's data):
- `math`: the responses the math example trains on: its answers plus EOS (2-4 tokens), at the
  example's max_new_tokens=5 and 32 prompts x n=8 = 256 rows.
- `longtail`: reasoning-style responses, lengths drawn log-normally (median T/4, capped at T=48),
  64 rows: synthetic (no model here writes long answers), the shape RL response lengths take.

Both sides run the local executor's real `update` (the loss of a PPO-clip step on the policy's
log-probs, backward, one SGD step with lr 0 so both see the same weights) at the same token budget
per micro-batch: padded micro-batches of `budget // (P+T)` rows against packed micro-batches of
`budget` real tokens. Medians over `--rounds` alternated rounds.

FLOPs (`ModelShape.flops_per_token`, training = 3x forward): the matmuls scale with the tokens run
(padded: rows x (P+T); packed: the real tokens); attention scores are counted as run: padded
rows x (P+T)^2, packed with the dense block-diagonal mask SDPA takes here sum over micro-batches of
L^2, and with a varlen kernel (flash-attention / flex_attention on GPU, untested) sum of len^2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlgraph.backends.local.models import load_tokenizer, tiny_config  # noqa: E402
from rlgraph.backends.local.packing import pack_rows, row_tokens  # noqa: E402
from rlgraph.backends.protocols import LossCounts, ModelRef, UpdateConfig  # noqa: E402
from rlgraph.batches import Rollouts  # noqa: E402
from rlgraph.plan.model_size import ModelShape  # noqa: E402
from rlgraph.plan.presets import load_model_config  # noqa: E402
from rlgraph.testing import tiny_executor  # noqa: E402

DATA = ROOT / "examples" / "math_grpo" / "train.jsonl"
SPREADS = {"math": dict(rows=256, steps=5), "longtail": dict(rows=64, steps=48)}


def batch_of(tokenizer, spread: str, rows: int, steps: int, seed: int = 0) -> Rollouts:
    """`rows` rollouts: math-example prompts (left-padded), responses of the spread's lengths."""
    g = torch.Generator().manual_seed(seed)
    lines = DATA.read_text().splitlines()
    picked = [json.loads(lines[int(i)]) for i in torch.randint(len(lines), (rows,), generator=g)]
    enc = tokenizer([row["question"] for row in picked], padding=True, return_tensors="pt")
    if spread == "math":  # the answer the policy is trained to write, then EOS
        answers = [tokenizer(row["answer"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                   for row in picked]
        lengths = [min(len(ids), steps) for ids in answers]
    else:
        drawn = torch.exp(torch.randn(rows, generator=g) * 0.8) * (steps / 4)  # log-normal, median T/4
        lengths = drawn.round().clamp(1, steps).long().tolist()
    mask = torch.arange(steps)[None] < torch.tensor(lengths)[:, None]  # [N, T]
    ids = torch.randint(4, len(tokenizer), (rows, steps), generator=g).masked_fill(~mask, tokenizer.pad_token_id)
    if spread == "math":
        for row, answer in enumerate(answers):
            ids[row, :lengths[row]] = torch.tensor(answer[:lengths[row]])
    old = (-torch.rand(rows, steps, generator=g) * 3).masked_fill(~mask, 0.0)  # [N, T]
    return Rollouts(enc["input_ids"], enc["attention_mask"].bool(), ids, mask, old, torch.arange(rows) // 8)


def ppo_clip(batch: Rollouts, advantages: torch.Tensor, clip: float = 0.2):
    """The executor's `LossFn`: PPO-clip, token mean over the mini-batch's global token count."""
    def loss_fn(rows, counts: LossCounts, lp, entropy):
        ratio = torch.exp(lp - batch.logprobs[rows])  # [n, T]
        adv = advantages[rows, None]  # [n, 1]
        surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)  # [n, T]
        return -(surrogate * batch.mask[rows]).sum() / counts.tokens, {}
    return loss_fn


def flops(shape: ModelShape, batch: Rollouts, budget: int) -> dict[str, float]:
    """Training FLOPs of one update, padded and packed (see the module docstring)."""
    rows, width = batch.mask.shape[0], batch.prompt_ids.shape[1] + batch.mask.shape[1]
    lengths = row_tokens(batch)
    linear = shape.flops_per_token(0, training=True)  # per token, without the attention scores
    scores = shape.flops_per_token(1, training=True) - linear  # per token, per token of context
    micros = pack_rows(torch.arange(rows), lengths, budget, "bench")
    return {
        "padded": rows * width * (linear + width * scores),
        "packed (dense mask)": int(lengths.sum()) * linear + sum(int(lengths[m].sum()) ** 2 for m in micros) * scores,
        "packed (varlen)": int(lengths.sum()) * linear + int((lengths ** 2).sum()) * scores,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spread", choices=sorted(SPREADS), nargs="+", default=sorted(SPREADS))
    parser.add_argument("--rows-per-micro", type=int, nargs="+", default=[4, 16],
                        help="padded rows a micro-batch; the packed budget is that x (P+T) tokens")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer()
    shape = ModelShape.from_hf_config(tiny_config(tokenizer))
    large = ModelShape.from_hf_config(load_model_config("qwen2.5-0.5b"))  # FLOPs only: where linears dominate
    executor = tiny_executor(lr=0.0)  # the tiny Qwen2, SGD at lr 0: both sides see the same weights
    print("| spread | rows | P+T | real tokens / padded | rows/micro (padded) | budget | padded ms | packed ms | "
          "packed/padded | FLOPs packed/padded: dense mask | varlen | Qwen2.5-0.5B shape: dense mask | varlen | "
          "loss difference |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for spread, per_micro in ((spread, per_micro) for spread in args.spread for per_micro in args.rows_per_micro):
        batch = batch_of(tokenizer, spread, **SPREADS[spread])
        rows, width = batch.mask.shape[0], batch.prompt_ids.shape[1] + batch.mask.shape[1]
        budget = per_micro * width
        advantages = torch.randn(rows, generator=torch.Generator().manual_seed(1))  # [N]
        configs = {"padded": UpdateConfig(micro_batch_size=per_micro, grad_clip=None),
                   "packed": UpdateConfig(micro_batch_tokens=budget, grad_clip=None)}
        times: dict[str, list[float]] = {name: [] for name in configs}
        losses: dict[str, float] = {}
        for _ in range(args.rounds + 1):  # the first round warms up both sides and is dropped
            for name, config in configs.items():
                begin = time.perf_counter()
                ref, stats = executor.update(executor.current("policy"), batch, ppo_clip(batch, advantages), config)
                times[name].append(time.perf_counter() - begin)
                losses[name] = stats["loss"]
        padded, packed = (statistics.median(times[name][1:]) for name in ("padded", "packed"))
        ratios = [counted[kind] / counted["padded"] for counted in (flops(shape, batch, budget), flops(large, batch, budget))
                  for kind in ("packed (dense mask)", "packed (varlen)")]
        real = int(row_tokens(batch).sum())
        print(f"| {spread} | {rows} | {width} | {real / (rows * width):.2f} | {per_micro} | {budget} | {padded * 1e3:.1f} | "
              f"{packed * 1e3:.1f} | {packed / padded:.2f} | " + " | ".join(f"{r:.2f}" for r in ratios)
              + f" | {abs(losses['padded'] - losses['packed']):.1e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
