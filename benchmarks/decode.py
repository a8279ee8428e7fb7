"""Decode step time: the eager lean loop against the compiled static-shape step, alternated in one run.

    .venv/bin/python benchmarks/decode.py                       # tiny Qwen2, 16 and 128 rows
    .venv/bin/python benchmarks/decode.py --rows 64 --tokens 32 --threads 2

Each round generates once with each generator (same prompts, seed and shapes) and times the whole
generate call; the compiled generator's first call (the compile) is reported apart. Medians over
`--rounds` rounds and their ratio.
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
from rlgraph.backends.local.models import build_causal_lm, load_tokenizer  # noqa: E402
from rlgraph.batches import Prompts  # noqa: E402


def prompts(tokenizer, rows: int) -> Prompts:
    texts = [f"{i % 100}+{(7 * i) % 100}=" for i in range(rows)]
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    return Prompts(enc["input_ids"], enc["attention_mask"].bool(), {"text": texts})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    tokenizer, model = load_tokenizer(None), build_causal_lm(None).eval()
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
