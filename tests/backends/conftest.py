"""Fixtures shared by the local-backend tests: the shipped tokenizer and a seeded tiny model."""

import pytest

from rlgraph.backends.local.models import build_causal_lm, load_tokenizer
from rlgraph.batches import Prompts


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return build_causal_lm(tokenizer=tokenizer, seed=0)


def prompts_of(tokenizer, texts):
    """Left-padded prompts for raw texts (the generator's input format)."""
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    return Prompts(enc["input_ids"], enc["attention_mask"].bool(), {"text": list(texts)})
