"""Decode step time: the eager lean loop against the compiled static-shape step, alternated in one run.

    .venv/bin/python benchmarks/decode.py                       # tiny Qwen2, 16 and 128 rows
    .venv/bin/python benchmarks/decode.py --rows 64 --tokens 32 --threads 2

Each round generates once with each generator (same prompts, seed and shapes) and times the whole
generate call; the compiled generator's first call (the compile) is reported apart. Medians over
`--rounds` rounds and their ratio.

    .venv/bin/python benchmarks/decode.py --prefill --prompts 8 --n 8 --width 48

`--prefill` times the prefill alone, alternated: each prompt prefilled once and its cache repeated
for its n samples (what `generate` does) against the N = B*n repeated rows prefilled (what it did).
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
from rlgraph.backends.local.lean_decode import LeanDecoder  # noqa: E402
from rlgraph.backends.local.models import build_causal_lm, load_tokenizer  # noqa: E402
from rlgraph.batches import Prompts  # noqa: E402


def prompts(tokenizer, rows: int) -> Prompts:
    texts = [f"{i % 100}+{(7 * i) % 100}=" for i in range(rows)]
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    return Prompts(enc["input_ids"], enc["attention_mask"].bool(), {"text": texts})


def prefill(model, args: argparse.Namespace) -> None:
    """Median ms of the lean prefill of `--prompts` prompts of `--width` tokens for `--n` samples each:
    once per prompt (then the cache repeated) against once per sample."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(4, model.config.vocab_size, (args.prompts, args.width), generator=generator)  # [B, P]
    mask = torch.ones_like(ids, dtype=torch.bool)  # [B, P]
    positions = torch.arange(args.width).expand(args.prompts, -1)  # [B, P]
    repeated = [t.repeat_interleave(args.n, 0) for t in (ids, mask, positions)]  # [N, P] each
    times = {"per sample": [], "once": []}
    with torch.no_grad():
        for _ in range(args.rounds + 1):  # the first round warms up
            for name, (rows, n) in (("per sample", (repeated, 1)), ("once", ((ids, mask, positions), args.n))):
                start = time.perf_counter()
                LeanDecoder(model).start(*rows, args.tokens, n)
                times[name].append(time.perf_counter() - start)
    each, once = (statistics.median(times[name][1:]) for name in ("per sample", "once"))
    print("| prompts x n | prompt tokens | prefill per sample ms | prefill once ms | ratio |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| {args.prompts} x {args.n} | {args.width} | {each * 1e3:.1f} | {once * 1e3:.1f} | {each / once:.2f}x |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefill", action="store_true", help="time the prefill alone: once per prompt vs per sample")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--width", type=int, default=48)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    tokenizer, model = load_tokenizer(None), build_causal_lm(None).eval()
    if args.prefill:
        prefill(model, args)
        return 0
    ids = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.tokens)
    print(f"| rows | tokens | eager ms/call | compiled ms/call | ratio | compile s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for rows in args.rows:
        batch = prompts(tokenizer, rows)
        eager, compiled = NativeGenerator(model, **ids), NativeGenerator(model, **ids, compile_decode=True)
        compiled.generate(batch, 1, params, seed=0)  # the compile, timed inside the generator
        times = {"eager": [], "compiled": []}
        for round_ in range(args.rounds):
            for name, generator in (("eager", eager), ("compiled", compiled)):
                start = time.perf_counter()
                generator.generate(batch, 1, params, seed=round_ + 1)
                times[name].append(time.perf_counter() - start)
        e, c = statistics.median(times["eager"]), statistics.median(times["compiled"])
        print(f"| {rows} | {args.tokens} | {e * 1e3:.1f} | {c * 1e3:.1f} | {e / c:.2f}x | {compiled.compile_seconds:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
