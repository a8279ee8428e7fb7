"""The memory of a multi-turn rollout (`rlgraph.plan.memory.rollout_memory`): each row's KV cache holds
its prompt and every turn and observation, sized from max_total_tokens, and the plan shows it."""

import pytest
import torch

import rlgraph as rg
from rlgraph.algorithms import agent_grpo
from rlgraph.plan import memory as M
from rlgraph.plan.memory import MemoryBreakdown
from rlgraph.plan.model_size import ModelShape
from rlgraph.plan.presets import get_preset

SMALL = ModelShape(hidden=8, layers=2, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=10, tie_embeddings=True)


def test_rollout_memory_by_hand():
    need = M.rollout_memory(SMALL, tp=1, rows=3, prompt_len=4, max_total_tokens=6, dtype=torch.float32)
    # KV: 3 rows x (4 + 6) tokens x (K,V x 2 layers x 1 kv head x 4 x 4 bytes) = 30 x 64; the first block
    # unchunked: 3 x 4 prompt tokens x 256 bytes (tests/plan/test_memory.py); sampler 3 x [3, 10] fp32;
    # one layer's K/V copy while the cache grows: 1920 / 2 layers.
    assert need == MemoryBreakdown(params=5088, kv_cache=1920, activations=3072, logits=360, workspace=960)
    split = M.rollout_memory(SMALL, tp=2, rows=3, prompt_len=4, max_total_tokens=6, dtype=torch.float32)
    assert (split.params, split.kv_cache, split.activations) == (2544, 1920, 1536)  # 1 kv head: replicated


def test_rollout_memory_refuses_empty_sizes():
    for bad in (dict(rows=0), dict(prompt_len=0), dict(max_total_tokens=-1)):
        sizes = {**dict(tp=1, rows=2, prompt_len=4, max_total_tokens=6), **bad}
        with pytest.raises(ValueError, match="rollout_memory: tp, rows, prompt_len and max_total_tokens"):
            M.rollout_memory(SMALL, **sizes)


def test_the_plan_sizes_the_rollout_cache_from_max_total_tokens():
    """A 0.5B policy, 16 prompts x n=8 episodes of 4096 tokens over 2 replicas: the generate phase's KV
    cache is 64 rows x (P + 4096) tokens, whatever T the compile was given; the stage prints it."""
    shape = ModelShape.from_hf_config(get_preset("qwen2.5-0.5b"))
    compiled = rg.compile(agent_grpo, mesh="gpu:2", placement=rg.colocated(), engine="native",
                          models={"policy": "qwen2.5-0.5b", "ref": "qwen2.5-0.5b"},
                          sizes={"B": 16, "P": 256, "T": 512}, n=8, max_turns=4, max_total_tokens=4096)
    expected = M.rollout_memory(shape, tp=1, rows=64, prompt_len=256, max_total_tokens=4096, dtype=torch.bfloat16)
    generate = compiled.memory_analysis()["policy"]["generate"]
    assert generate["kv_cache"] == expected.kv_cache == 64 * (256 + 4096) * shape.kv_cache_bytes_per_token(torch.bfloat16)
    assert generate["activations"] == expected.activations
    assert f"each row continues from its KV cache ({M.format_bytes(expected.kv_cache)}/replica: 64 rows x (P + 4096) tokens)" \
        in compiled.as_text()
