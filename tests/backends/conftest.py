"""Fixtures shared by the backend tests: the shipped tokenizer, a seeded tiny model, a one-rank gloo group,
and one live vLLM engine per session (one per process: vLLM's in-process engine owns the process's
torch.distributed world)."""

import copy
import json
import os

import pytest
import torch
import torch.distributed as dist

from rlgraph.backends.local.models import TINY_VLLM_CONFIG, build_causal_lm, load_tokenizer
from rlgraph.batches import Prompts


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return build_causal_lm(tokenizer=tokenizer, seed=0)


@pytest.fixture
def gloo():
    """A torch.distributed job of one rank (gloo): enough to build the FSDP2 executor in this process."""
    from rlgraph.runtime.spmd import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def prompts_of(tokenizer, texts):
    """Left-padded prompts for raw texts (the generator's input format)."""
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    return Prompts(enc["input_ids"], enc["attention_mask"].bool(), {"text": list(texts)})


# -- a live vLLM engine (in .venv-vllm: tests/backends/test_vllm_live.py, test_vllm_local.py) ----------

BUCKET = 5  # parameters per bucket: the tiny model's 24 arrive in 5 buckets that split its layers
# A larger init than the shipped 0.02 spreads the logits, so greedy argmaxes are not near-ties that
# the two engines' different (both fp32) GEMM orders could flip.
INIT_RANGE = 0.3
# The engine's KV block, the prefix cache's unit: the smallest vLLM's CPU attention takes (a multiple
# of 32; its default is 128), so the multi-turn tests' short contexts fill whole blocks.
BLOCK_TOKENS = 32


def buckets(model, size=BUCKET):
    named = [(name, param.detach()) for name, param in model.named_parameters()]
    return [named[start:start + size] for start in range(0, len(named), size)]


def sync(engine, model, version):
    for bucket in buckets(model):
        engine.load_weights(bucket)
    engine.finish_sync(version)


@pytest.fixture(scope="session")
def vllm_live(tmp_path_factory):
    """(engine, the HF model it was synced from at version 0, tokenizer). The engine starts with dummy
    weights from the config alone, so every weight it serves came through a sync."""
    from rlgraph.backends.vllm.engine import VLLMEngine, launcher_env

    for key, value in launcher_env().items():
        os.environ.setdefault(key, value)
    tokenizer = load_tokenizer()
    config = {**json.loads(TINY_VLLM_CONFIG.read_text()), "initializer_range": INIT_RANGE}
    model = build_causal_lm(config, tokenizer=tokenizer, seed=0).eval()
    directory = tmp_path_factory.mktemp("tiny_qwen2_vllm")
    model.config.save_pretrained(directory)  # config only: load_format="dummy"
    # fp32 on CUDA too (make gpu-check runs these modules there), so the parity bounds hold on both
    engine = VLLMEngine.build(directory, role="policy", eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id, load_format="dummy", enforce_eager=True,
                              max_model_len=64, dtype="float32", block_size=BLOCK_TOKENS)
    sync(engine, model, 0)
    return engine, model, tokenizer


def randomise_adapters(policy, seed):
    """Give a LoRA policy's B matrices random values (peft starts them at 0): its adapters then matter."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)


@pytest.fixture(scope="session")
def lora_live(vllm_live):
    """(engine, LoRA policy, tokenizer): a second engine in this process, built by `build_local_engine`
    from the policy's frozen base with vLLM's LoRA layers on. Session-scoped like `vllm_live`: the two
    engines share this process's vLLM parallel groups, and the first one shut down would take them
    from the other (a run has one engine per process)."""
    from rlgraph.backends.lora import LoraSettings, apply_lora
    from rlgraph.backends.vllm.local import build_local_engine

    _, model, tokenizer = vllm_live
    policy = apply_lora(copy.deepcopy(model), LoraSettings(r=4, alpha=8, target_modules=("q_proj", "v_proj", "up_proj")))
    randomise_adapters(policy, seed=0)
    engine = build_local_engine(policy, role="policy", tokenizer=tokenizer, seed=0, max_model_len=64)
    return engine, policy.eval(), tokenizer

