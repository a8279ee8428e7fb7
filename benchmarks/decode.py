"""Decode time: the eager lean loop, the compiled static-shape step (a call a token) and the compiled
chunk (k tokens and their sampling a call, the compiled prefill), alternated in one run.

    .venv/bin/python benchmarks/decode.py                       # tiny Qwen2, 16 and 128 rows
    .venv/bin/python benchmarks/decode.py --rows 8 16 64 --samples 4 --threads 1 --chunk 4 8 16

Each round generates once with each generator (same prompts, seed and shapes) and times the whole
generate call; each compiled generator's first call (the compile) is reported apart. Medians over
`--rounds` rounds and their ratios to eager. `--samples s`: rows/s prompts of s samples each (the
prefill runs once per prompt). `--chunk k ...`: one chunk side per k (`decode_compile.CHUNK_STEPS`).

    .venv/bin/python benchmarks/decode.py --prefill --prompts 8 --n 8 --width 48

`--prefill` times the prefill alone, alternated: each prompt prefilled once and its cache repeated
for its n samples (what `generate` does) against the N = B*n repeated rows prefilled (what it did),
and the once-per-prompt prefill compiled (what a compiled decode runs; its compile before the rounds).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlgraph.backends.local import decode_compile  # noqa: E402
from rlgraph.backends.local.generation import NativeGenerator
from rlgraph.backends.local.counter_sampling import SamplingParams
from rlgraph.backends.local.lean_decode import LeanDecoder  # noqa: E402
from rlgraph.backends.local.models import build_causal_lm, load_tokenizer  # noqa: E402
from rlgraph.batches import Prompts  # noqa: E402


def prompts(tokenizer, rows: int) -> Prompts:
    texts = [f"{i % 100}+{(7 * i) % 100}=" for i in range(rows)]
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    return Prompts(enc["input_ids"], enc["attention_mask"].bool(), {"text": texts})


def prefill(model, args: argparse.Namespace) -> None:
    """Median ms of the lean prefill of `--prompts` prompts of `--width` tokens for `--n` samples each:
    once per prompt (then the cache repeated) against once per sample, and once per prompt compiled."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(4, model.config.vocab_size, (args.prompts, args.width), generator=generator)  # [B, P]
    mask = torch.ones_like(ids, dtype=torch.bool)  # [B, P]
    positions = torch.arange(args.width).expand(args.prompts, -1)  # [B, P]
    repeated = [t.repeat_interleave(args.n, 0) for t in (ids, mask, positions)]  # [N, P] each
    sides = {"per sample": (repeated, 1, False), "once": ((ids, mask, positions), args.n, False),
             "once, compiled": ((ids, mask, positions), args.n, True)}
    times = {name: [] for name in sides}
    with torch.no_grad():
        LeanDecoder(model).start(ids, mask, positions, args.tokens, args.n, compiled=True)  # the compile
        for _ in range(args.rounds + 1):  # the first round warms up
            for name, (rows, n, compiled) in sides.items():
                start = time.perf_counter()
                LeanDecoder(model).start(*rows, args.tokens, n, compiled=compiled)
                times[name].append(time.perf_counter() - start)
    each, once, compiled = (statistics.median(times[name][1:]) for name in sides)
    print("| prompts x n | prompt tokens | prefill per sample ms | prefill once ms | once, compiled ms | ratio once | "
          "ratio compiled/once |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print(f"| {args.prompts} x {args.n} | {args.width} | {each * 1e3:.2f} | {once * 1e3:.2f} | {compiled * 1e3:.2f} | "
          f"{each / once:.2f}x | {once / compiled:.2f}x |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--samples", type=int, default=1, help="samples per prompt: rows/samples prompts")
    parser.add_argument("--chunk", type=int, nargs="+", default=[decode_compile.CHUNK_STEPS],
                        help="k of the compiled chunk sides")
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
    chunks = [f"chunk k={k}" for k in args.chunk]
    ratios = " | ".join(f"{c}: vs eager, vs step" for c in chunks)
    print(f"| rows | tokens | eager ms/call | step ms/call | {' | '.join(f'{c} ms/call' for c in chunks)} | "
          f"step/eager | {ratios} | compile s (step, {', '.join(chunks)}) |")
    print("|" + " --- |" * (6 + 2 * len(chunks)))
    for rows in args.rows:
        batch = prompts(tokenizer, rows // args.samples)
        sides = {"eager": NativeGenerator(model, **ids), "step": NativeGenerator(model, **ids, compile_decode=True,
                                                                                  chunked=False)}
        sides.update({name: NativeGenerator(model, **ids, compile_decode=True) for name in chunks})
        for name, k in zip(chunks, args.chunk):  # the compiles, timed inside the generators
            decode_compile.CHUNK_STEPS = k
            sides[name].generate(batch, args.samples, params, seed=0)
        sides["step"].generate(batch, args.samples, params, seed=0)
        times = {name: [] for name in sides}
        for round_ in range(args.rounds):
            for name, generator in sides.items():
                if name in chunks:
                    decode_compile.CHUNK_STEPS = args.chunk[chunks.index(name)]
                start = time.perf_counter()
                generator.generate(batch, args.samples, params, seed=round_ + 1)
                times[name].append(time.perf_counter() - start)
        ms = {name: statistics.median(values) * 1e3 for name, values in times.items()}
        cells = [f"{rows}", f"{args.tokens}", *(f"{ms[name]:.2f}" for name in sides)]
        cells.append(f"{ms['eager'] / ms['step']:.2f}x")
        cells += [f"{ms['eager'] / ms[name]:.2f}x, {ms['step'] / ms[name]:.2f}x" for name in chunks]
        cells.append(", ".join(f"{sides[name].compile_seconds:.1f}" for name in ["step", *chunks]))
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
