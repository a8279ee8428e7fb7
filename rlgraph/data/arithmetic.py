"""The CPU demo task: two-number addition, `"A+B="` -> `str(A+B)`.

Every pair (A, B) in the range is one problem; a seeded shuffle splits them into test, dev and
train with no pair in two splits. `PromptSampler` walks the train split in seeded, reshuffled
epochs and can be checkpointed, so a resumed run sees exactly the batches it would have seen.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch
from transformers import PreTrainedTokenizerBase

from rlgraph.batches import Prompts, Rollouts


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
    encoded = tokenizer(texts, padding=True, padding_side="left", return_tensors="pt")
    return Prompts(encoded["input_ids"], encoded["attention_mask"].bool(),  # [B, P], [B, P]
                   {"answer": [p.answer for p in problems], "text": texts})


def to_demonstrations(problems: Sequence[Problem], tokenizer: PreTrainedTokenizerBase) -> Rollouts:
    """SFT batch: each response is the answer's characters then EOS, right-padded with the pad id."""
    if tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
        raise ValueError("to_demonstrations: the tokenizer needs eos and pad tokens; use rlgraph's character tokenizer")
    answers = tokenizer([p.answer for p in problems], add_special_tokens=False)["input_ids"]
    steps = max(len(a) for a in answers) + 1
    response = torch.full((len(problems), steps), tokenizer.pad_token_id, dtype=torch.long)  # [B, T]
    mask = torch.zeros(len(problems), steps, dtype=torch.bool)  # [B, T]
    for row, answer in enumerate(answers):
        response[row, : len(answer) + 1] = torch.tensor([*answer, tokenizer.eos_token_id])
        mask[row, : len(answer) + 1] = True
    return Rollouts.from_demonstrations(to_prompts(problems, tokenizer), response, mask)


class PromptSampler:
    """Endless batches of `batch_size` problems: each epoch is a fresh seeded shuffle of `problems`
    (the tail that does not fill a batch is skipped); `state_dict()` / `load_state_dict()` resume
    the exact sequence of batches."""

    def __init__(self, problems: Sequence[Problem], batch_size: int, *, seed: int = 0) -> None:
        if not 1 <= batch_size <= len(problems):
            raise ValueError(f"PromptSampler: batch_size must be in [1, {len(problems)}] (the number of problems), "
                             f"got {batch_size}")
        self.problems = tuple(problems)
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.problems), generator=generator).tolist()

    def next_batch(self) -> list[Problem]:
        if self.position + self.batch_size > len(self.problems):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._epoch_order(self.epoch)
        index = self._order[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return [self.problems[i] for i in index]

    def __iter__(self) -> Iterator[list[Problem]]:
        return self

    def __next__(self) -> list[Problem]:
        return self.next_batch()

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position,
                "batch_size": self.batch_size, "num_problems": len(self.problems)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from `state_dict()`; refuses a state saved for other problems or batch size."""
        expected = {"batch_size": self.batch_size, "num_problems": len(self.problems)}
        found = {key: state.get(key) for key in expected}
        if found != expected:
            raise ValueError(f"PromptSampler.load_state_dict: the state was saved with {found}, this sampler has "
                             f"{expected}; build the sampler with the same problems and batch size")
        self.seed, self.epoch, self.position = int(state["seed"]), int(state["epoch"]), int(state["position"])
        self._order = self._epoch_order(self.epoch)
