"""vLLM's prefix cache across the turns of a multi-turn rollout (issue 33): context tokens each turn
sends as ids, and how many of them the cache served (`VLLMEngine.turn_cache`), with the seconds.

    PYTHONPATH=$PWD VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python benchmarks/vllm_prefix_cache.py

The tiny head_dim-32 model (random weights, init range 0.3), an environment whose first observation
is 30 digits (so a row's first context fills one 32-token block) and which answers "12" to the first
turn; 2 turns of at most 4 tokens; an engine with `block_size=32`. Run in .venv-vllm (docs/vllm.md).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import rlgraph as rg
from rlgraph.backends.local.state import LMWorker
from rlgraph.backends.local.models import TINY_VLLM_CONFIG, build_causal_lm, load_tokenizer
from rlgraph.backends.protocols import EnvRef
from rlgraph.backends.vllm.engine import VLLMEngine, launcher_env
from rlgraph.backends.vllm.local import VLLMLocalExecutor
from rlgraph.testing import tiny_prompts


class Digits(rg.Env):
    def reset(self, row):
        self.turn = 0
        return "0123456789" * 3

    def step(self, text):
        self.turn += 1
        return rg.Step("12", reward=0.0, done=self.turn >= 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="8x4,16x8", help="prompts x samples per prompt, comma-separated")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    os.environ.update({key: value for key, value in launcher_env().items() if key not in os.environ})
    tokenizer = load_tokenizer()
    config = {**json.loads(TINY_VLLM_CONFIG.read_text()), "initializer_range": 0.3}
    model = build_causal_lm(config, tokenizer=tokenizer, seed=0).eval()
    with tempfile.TemporaryDirectory(prefix="rlgraph-bench-") as directory:
        model.config.save_pretrained(directory)
        engine = VLLMEngine.build(directory, role="policy", eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id, load_format="dummy", enforce_eager=True,
                                  max_model_len=64, dtype="float32", block_size=32)
    executor = VLLMLocalExecutor({"policy": LMWorker(model)}, {}, tokenizer, engine=engine, max_new_tokens=44,
                                 envs={"env": Digits})
    executor.sync_weights(executor.current("policy"))
    print("| prompts x n | rows | run | seconds | turn 1: sent / cached tokens | turn 2: sent / cached tokens |")
    print("| --- | --- | --- | --- | --- | --- |")
    for repeat in range(args.repeats):
        for shape in args.shapes.split(","):
            prompts, n = (int(part) for part in shape.split("x"))
            start = time.perf_counter()
            rollouts, _, _ = executor.rollout(executor.current("policy"), EnvRef("env"), tiny_prompts(prompts), n=n,
                                              max_turns=2, max_tokens_per_turn=4, max_total_tokens=44)
            seconds = time.perf_counter() - start
            turns = " | ".join(f"{sent} / {cached}" for sent, cached in engine.turn_cache)
            print(f"| {prompts} x {n} | {len(rollouts)} | {repeat + 1} | {seconds:.2f} | {turns} |")
            engine.llm.reset_prefix_cache()  # each run starts cold


if __name__ == "__main__":
    main()
