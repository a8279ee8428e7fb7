"""vLLM's CPU build against rlgraph's native engine, and vLLM's weight sync against model size.

Run in `.venv-vllm` (docs/vllm.md); one vLLM engine per process, so each part is its own process:

    PYTHONPATH=. .venv-vllm/bin/python benchmarks/vllm_cpu.py generate --rounds 3
    PYTHONPATH=. .venv-vllm/bin/python benchmarks/vllm_cpu.py sync --size tiny|43m|0.5b
    PYTHONPATH=. .venv-vllm/bin/python benchmarks/vllm_cpu.py all      # every part, one JSON line each

`generate`: the engine's start-up seconds (in-process `vllm.LLM`, dummy weights, 64 MiB KV cache),
then at two shapes the native engine and vLLM in turns (`--rounds` each, sides alternated in one
run), same fp32 weights, temperature 1: tokens/s (response tokens kept) and samples/s, the median
round. `sync`: a random model of the size's shape, the engine started from its config, then a
sync of every weight in 512 MiB buckets (the plan's default), timed `--rounds` times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

SHAPES = {"32 prompts x 8, 5 tokens": (32, 8, 5), "8 prompts x 4, 32 tokens": (8, 4, 32)}
# Qwen2 shapes: the shipped tiny one with head_dim 32, a ~43M one, and Qwen2.5-0.5B's (vocabulary included).
SIZES = {
    "tiny": {},
    "43m": {"hidden_size": 512, "intermediate_size": 1600, "num_hidden_layers": 12, "num_attention_heads": 8,
            "num_key_value_heads": 8, "max_position_embeddings": 512},
    "0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 512},
}


def _engine(model, tokenizer, max_model_len):
    from rlgraph.backends.vllm.local import build_local_engine

    start = time.perf_counter()
    engine = build_local_engine(model, role="policy", tokenizer=tokenizer, seed=0, max_model_len=max_model_len)
    return engine, time.perf_counter() - start


def _sync(engine, model, version, bucket_bytes=512 << 20):
    from rlgraph.backends.vllm.local import weight_buckets

    start = time.perf_counter()
    for bucket in weight_buckets(model, bucket_bytes):
        engine.load_weights(bucket)
    engine.finish_sync(version)
    return time.perf_counter() - start


def _model(size, tokenizer):
    from rlgraph.backends.local.models import TINY_VLLM_CONFIG, build_causal_lm

    config = {**json.loads(TINY_VLLM_CONFIG.read_text()), **SIZES[size]}
    return build_causal_lm(config, tokenizer=tokenizer, seed=0).eval()


def generate(rounds: int) -> dict:
    from rlgraph.backends.local.generation import NativeGenerator
    from rlgraph.backends.local.counter_sampling import SamplingParams
    from rlgraph.backends.local.models import load_tokenizer
    from rlgraph.backends.protocols import ModelRef
    from rlgraph.testing import tiny_prompts

    tokenizer = load_tokenizer()
    model = _model("tiny", tokenizer)
    engine, startup = _engine(model, tokenizer, max_model_len=64)
    _sync(engine, model, 0)
    native = NativeGenerator(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    result = {"part": "generate", "startup_s": round(startup, 2), "threads": torch.get_num_threads(), "shapes": {}}
    for label, (prompts_count, n, tokens) in SHAPES.items():
        prompts, params = tiny_prompts(prompts_count), SamplingParams(temperature=1.0, max_new_tokens=tokens)
        sides = {
            "native": lambda call: native.generate(prompts, n, params, seed=0, call=call),
            "vllm": lambda call: engine.generate(prompts, n, params, seed=0, call=call, model=ModelRef("policy", 0)),
        }
        times = {side: [] for side in sides}
        kept = {}
        for call in range(rounds + 1):  # round 0 warms both up and is not counted
            for side, run in sides.items():
                start = time.perf_counter()
                with torch.no_grad():
                    rollouts = run(call)
                if call:
                    times[side].append(time.perf_counter() - start)
                kept[side] = int(rollouts.mask.sum())
        result["shapes"][label] = {
            side: {"s": round(statistics.median(times[side]), 4),
                   "tokens_per_s": round(kept[side] / statistics.median(times[side]), 1),
                   "samples_per_s": round(prompts_count * n / statistics.median(times[side]), 1)} for side in sides}
    return result


def sync(size: str, rounds: int) -> dict:
    from rlgraph.backends.local.models import load_tokenizer

    tokenizer = load_tokenizer()
    model = _model(size, tokenizer)
    params = sum(param.numel() for param in model.parameters())
    engine, startup = _engine(model, tokenizer, max_model_len=64)
    seconds = [_sync(engine, model, version) for version in range(rounds)]
    return {"part": "sync", "size": size, "params": params, "fp32_mib": round(params * 4 / 2**20, 1),
            "startup_s": round(startup, 2), "sync_s": [round(value, 3) for value in seconds],
            "sync_s_median": round(statistics.median(seconds), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=("generate", "sync", "all"))
    parser.add_argument("--size", choices=tuple(SIZES), default="tiny")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.part == "all":  # one process per engine
        for part in (["generate"], *(["sync", "--size", size] for size in SIZES)):
            subprocess.run([sys.executable, __file__, *part, "--rounds", str(args.rounds)], check=True, env=os.environ)
        return
    result = generate(args.rounds) if args.part == "generate" else sync(args.size, args.rounds)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
