"""The FSDP2 executor drives a vLLM engine through its sync, offload and onload steps (a fake vLLM
in one gloo process; tests/backends/test_vllm_live.py runs a live one on CPU, and sleep mode on a GPU is untested)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import rlgraph as rg
from rlgraph.algorithms import ALGORITHMS
from rlgraph.backends.protocols import ModelRef
from rlgraph.backends.vllm.engine import VLLMEngine
from rlgraph.backends.world import RoleSpec, WorldSpec
from rlgraph.runtime.spmd import free_port
from rlgraph.runtime.transport import SyncRoute
from tests.backends.test_vllm import EOS, PAD, FakeLLM, fake_vllm  # noqa: F401 (a fixture)


@pytest.fixture
def executor(fake_vllm):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        plan = rg.compile(ALGORITHMS["grpo"], mesh="cpu:1", placement=rg.colocated(offload=True, checkpointing=False),
                          sizes={"B": 2, "P": 8, "T": 4}, n=2, max_new_tokens=4, engine="native").plan
        world = WorldSpec({"policy": RoleSpec(optimizer="sgd", lr=0.1)}, max_new_tokens=4)
        executor = world.build(0, plan, torch.device("cpu"))
        executor.engines["policy"] = VLLMEngine(FakeLLM(), role="policy", eos_token_id=EOS, pad_token_id=PAD)
        yield executor
    finally:
        dist.destroy_process_group()


def test_sync_loads_every_trained_weight_into_vllm_bucket_by_bucket_then_serves_the_version(executor):
    engine = executor.engines["policy"]
    executor.sync_weights(ModelRef("policy", 0), SyncRoute("policy", (0,), (0,), buckets=8, bucket_bytes=64 << 10))
    loaded = engine.llm.model.loaded
    assert len(loaded) > 1  # several buckets
    trained = dict(executor.models["policy"].model.module.named_parameters())
    names = [name for bucket in loaded for name, _ in bucket]
    assert names == list(trained)  # Hugging Face names, every parameter once, in order
    for bucket in loaded:
        for name, tensor in bucket:
            assert torch.equal(tensor, trained[name].full_tensor())
    assert engine.llm.model.reloads == ["start", "finish"]  # one layerwise reload around all the buckets
    assert engine.version == 0 and ("reset_prefix_cache",) in engine.llm.calls
    engine.require(ModelRef("policy", 0))


def test_vllm_sleeps_while_the_trainer_works_and_wakes_for_generation(executor):
    engine = executor.engines["policy"]
    executor.offload("policy", "onload")       # before an update: the engine gives the device back
    assert engine.asleep == {"weights", "kv_cache"} and engine.llm.calls[-1] == ("sleep", 1)
    executor.sync_weights(ModelRef("policy", 0), SyncRoute("policy", (0,), (0,), buckets=1, bucket_bytes=1 << 30))
    assert engine.asleep == {"kv_cache"}        # weights woke to be loaded; the KV cache waits for generation
    executor.offload("policy", "offload")      # before generate
    assert not engine.asleep and engine.llm.calls[-1] == ("wake_up", ["kv_cache"])


def test_a_ranks_vllm_engine_for_a_vision_language_role_is_refused_with_the_reason_before_vllm_starts():
    from types import SimpleNamespace

    from rlgraph.backends.fsdp.build import _vllm_engine
    from rlgraph.backends.local.vlm import build_vl_tokenizer, tiny_vl_config
    from rlgraph.backends.vllm import VISION_ON_VLLM, VLLMError

    tokenizer = build_vl_tokenizer()
    spec = RoleSpec(source=tiny_vl_config(tokenizer))
    group = SimpleNamespace(generate=SimpleNamespace(tp=1))
    with pytest.raises(VLLMError, match=r"role 'policy' \(model .*\): a qwen2_vl model; " + VISION_ON_VLLM[:40]):
        _vllm_engine(SimpleNamespace(seed=0), spec, "policy", group, 0, tokenizer, torch.device("cpu"))
