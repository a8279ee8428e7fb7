"""Fixtures shared by the backend tests: the shipped tokenizer, a seeded tiny model, a one-rank gloo group."""

import pytest
import torch.distributed as dist

from rlgraph.backends.local.models import build_causal_lm, load_tokenizer
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
