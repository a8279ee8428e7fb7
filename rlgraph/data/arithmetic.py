"""The CPU demo task: two-number addition, `"A+B="` -> `str(A+B)`.

Every pair (A, B) in the range is one problem; a seeded shuffle splits them into test, dev and
train with no pair in two splits. `PromptSampler` walks the train split in seeded, reshuffled
epochs and can be checkpointed, so a resumed run sees exactly the batches it would have seen.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch
from transformers import PreTrainedTokenizerBase

from rlgraph.batches import Prompts, Rollouts
from rlgraph.data.prompts import encode_prompts, encode_responses
from rlgraph.data.sampler import Sampler


@attrs.frozen
class Problem:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> str:
        return str(self.a + self.b)


@attrs.frozen
class Splits:
    train: tuple[Problem, ...]
    dev: tuple[Problem, ...]
    test: tuple[Problem, ...]


def make_splits(seed: int = 0, *, low: int = 0, high: int = 99, test_size: int = 200, dev_size: int = 200) -> Splits:
    """All pairs with A, B in [low, high], shuffled by `seed`: the first `test_size` are the test
    split, the next `dev_size` the dev split, the rest train. Same arguments, same splits."""
    if low > high or low < 0:
        raise ValueError(f"make_splits: need 0 <= low <= high, got low={low}, high={high}")
    pairs = [Problem(a, b) for a in range(low, high + 1) for b in range(low, high + 1)]
    if test_size < 0 or dev_size < 0 or test_size + dev_size >= len(pairs):
        raise ValueError(f"make_splits: test_size={test_size} + dev_size={dev_size} must leave some of the "
                         f"{len(pairs)} problems in [{low}, {high}] for training; widen the range or shrink the splits")
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(seed)).tolist()
    shuffled = tuple(pairs[i] for i in order)
    return Splits(train=shuffled[test_size + dev_size :], dev=shuffled[test_size : test_size + dev_size],
                  test=shuffled[:test_size])


def to_prompts(problems: Sequence[Problem], tokenizer: PreTrainedTokenizerBase) -> Prompts:
    """Left-padded prompts with `meta = {"answer": [...], "text": [...]}`."""
    texts = [p.prompt for p in problems]
    ids, mask = encode_prompts(texts, tokenizer)  # [B, P], [B, P]
    return Prompts(ids, mask, {"answer": [p.answer for p in problems], "text": texts})


def to_demonstrations(problems: Sequence[Problem], tokenizer: PreTrainedTokenizerBase) -> Rollouts:
    """SFT batch: each response is the answer's characters then EOS, right-padded with the pad id."""
    response, mask = encode_responses([p.answer for p in problems], tokenizer)  # [B, T], [B, T]
    return Rollouts.from_demonstrations(to_prompts(problems, tokenizer), response, mask)


class PromptSampler(Sampler):
    """`Sampler` over problems (the demo's name for it): same seed, same batches as before."""

    noun = "problems"

    def __init__(self, problems: Sequence[Problem], batch_size: int, *, seed: int = 0) -> None:
        super().__init__(problems, batch_size, seed=seed)

    @property
    def problems(self) -> tuple[Problem, ...]:
        return self.items
