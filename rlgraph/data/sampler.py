"""Seeded, resumable batches over any list of items (prompts, problems, rows).

Each epoch is a fresh shuffle drawn from `seed` and the epoch number alone, so the batch at step k
depends only on (items, batch_size, seed, k): a run resumed from `state_dict()` sees exactly the
batches an uninterrupted run would have seen. The tail of an epoch that does not fill a batch is
skipped (it lands in some other epoch's batches, because every epoch reshuffles).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from rlgraph.errors import ConfigError

# Mixes the seed and the epoch into one torch seed; kept fixed so old runs resume bit-for-bit.
_EPOCH_STRIDE = 1_000_003


class Sampler:
    """Endless batches of `batch_size` items in seeded, reshuffled epochs.

    >>> sampler = Sampler(list("abcdef"), 2, seed=0)
    >>> len(sampler.next_batch()), sampler.batches_per_epoch
    (2, 3)

    `shuffle=False` walks the items in order every epoch (useful for evaluation or debugging).
    """

    noun = "items"  # what the error messages call the items; subclasses rename it

    def __init__(self, items: Sequence[Any], batch_size: int, *, seed: int = 0, shuffle: bool = True) -> None:
        name = type(self).__name__
        if len(items) == 0:
            raise ConfigError(f"{name}: got no {self.noun} to sample from", fix="check that the data loaded any rows")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= len(items):
            raise ConfigError(f"{name}: batch_size must be an integer in [1, {len(items)}] (the number of "
                              f"{self.noun}), got {batch_size!r}", fix=f"use a batch size of at most {len(items)}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"{name}: seed must be an integer, got {seed!r}")
        self.items = tuple(items)
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = bool(shuffle)
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order(0)

    @property
    def batches_per_epoch(self) -> int:
        return len(self.items) // self.batch_size

    def _epoch_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.items)))
        generator = torch.Generator().manual_seed(self.seed * _EPOCH_STRIDE + epoch)
        return torch.randperm(len(self.items), generator=generator).tolist()

    def next_batch(self) -> list[Any]:
        if self.position + self.batch_size > len(self.items):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._epoch_order(self.epoch)
        index = self._order[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return [self.items[i] for i in index]

    def __iter__(self) -> Iterator[list[Any]]:
        return self

    def __next__(self) -> list[Any]:
        return self.next_batch()

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position, "batch_size": self.batch_size,
                "num_items": len(self.items), "shuffle": int(self.shuffle)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from `state_dict()`; refuses a state saved for another item count, batch size or
        shuffle setting, since it would silently replay different batches."""
        name = type(self).__name__
        missing = [key for key in ("seed", "epoch", "position", "batch_size") if key not in state]
        if missing:
            raise ConfigError(f"{name}.load_state_dict: the state lacks {missing}; it has {sorted(state)}",
                              fix="pass the dict that Sampler.state_dict() returned")
        count = state.get("num_items", state.get("num_problems"))  # "num_problems": states saved by PromptSampler
        found = {"batch_size": state["batch_size"], f"num_{self.noun}": count}
        expected = {"batch_size": self.batch_size, f"num_{self.noun}": len(self.items)}
        if "shuffle" in state:
            found["shuffle"], expected["shuffle"] = bool(state["shuffle"]), self.shuffle
        if found != expected:
            raise ConfigError(f"{name}.load_state_dict: the state was saved with {found}, this sampler has "
                              f"{expected}", fix=f"build the sampler with the same {self.noun} and batch size")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= len(self.items):
            raise ConfigError(f"{name}.load_state_dict: epoch={epoch}, position={position} is out of range for "
                              f"{len(self.items)} {self.noun}", fix="pass the dict that Sampler.state_dict() returned")
        self.seed, self.epoch, self.position = int(state["seed"]), epoch, position
        self._order = self._epoch_order(self.epoch)
