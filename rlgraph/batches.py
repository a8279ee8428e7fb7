"""The two batch containers that cross every layer: `Prompts` and `Rollouts`.

They are plain frozen records of tensors (plus per-row metadata such as reference answers).
The same classes serve as annotations in an algorithm's signature (`prompts: rg.Prompts`) and as
the runtime values the executors exchange, so there is one name per concept.

Conventions (symbolic dims as in DESIGN.md):
- prompts are *left*-padded to P tokens, responses *right*-padded to T tokens;
- masks are `bool`; log-probs are `float32`;
- `group[i]` is the prompt index a rollout was sampled from (rows of a group are contiguous).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch

from rlgraph.errors import ConfigError

Meta = Mapping[str, Sequence[Any]]


class BatchError(ConfigError):
    """A `Prompts` or `Rollouts` that breaks the conventions above; names the field and the sample.
    A ValueError too (as ConfigError), as these checks raised before."""


def _check_meta(meta: Meta, rows: int, where: str) -> None:
    for key, values in meta.items():
        if len(values) != rows:
            raise BatchError(
                f"{where}: metadata field {key!r} has {len(values)} entries, expected one per row ({rows})"
            )


def _take(meta: Meta, index: Sequence[int]) -> dict[str, list[Any]]:
    return {key: [values[i] for i in index] for key, values in meta.items()}


def _pad(tensor: torch.Tensor, width: int, value: Any, *, left: bool = False) -> torch.Tensor:
    """[R, w] -> [R, width], filled with `value` on the right (or the left)."""
    extra = tensor.new_full((tensor.shape[0], width - tensor.shape[1]), value)
    return torch.cat([extra, tensor] if left else [tensor, extra], dim=1)


def _first_appearance(group: torch.Tensor) -> torch.Tensor:
    """Group ids renumbered 0, 1, ... in order of first appearance: [7, 7, 2, 2, 7] -> [0, 0, 1, 1, 0]."""
    ids, inverse = torch.unique(group, return_inverse=True)
    first = torch.full((len(ids),), len(group), dtype=torch.long).scatter_reduce(
        0, inverse, torch.arange(len(group)), "amin")  # [G]: first row of each id
    rank = torch.empty_like(first)
    rank[first.argsort()] = torch.arange(len(ids))
    return rank[inverse]  # [R]


def _check_images(record: Any, rows: int) -> None:
    """A record's images: none, or `pixel_values` f32[R, K, D] (each row's image patches in order,
    zero-padded after its own) with `image_grid_thw` i64[R, I, 3] (each row's images' patch grids
    (t, h, w); all-zero rows pad), whose patches fit the row's K."""
    where = type(record).__name__
    pixels, grid = record.pixel_values, record.image_grid_thw
    if pixels is None and grid is None:
        return
    if pixels is None or grid is None:
        raise BatchError(f"{where}: pixel_values and image_grid_thw come together; got only "
                         f"{'pixel_values' if grid is None else 'image_grid_thw'}",
                         fix="build both with rlgraph.backends.local.vlm.vl_prompts (or pass neither for text)")
    if pixels.dim() != 3 or pixels.shape[0] != rows or not pixels.is_floating_point():
        raise BatchError(f"{where}.pixel_values must be a float [R, K, D] with R={rows} rows (each row's patches), got "
                         f"{pixels.dtype} {tuple(pixels.shape)}")
    if grid.dim() != 3 or grid.shape[0] != rows or grid.shape[2] != 3 or grid.dtype != torch.long:
        raise BatchError(f"{where}.image_grid_thw must be i64[R, I, 3] with R={rows} rows (each row's image grids), "
                         f"got {grid.dtype} {tuple(grid.shape)}")
    if grid.is_meta or not grid.numel():
        return
    patches = grid.prod(-1).sum(-1)  # [R]: each row's patches
    if bool((grid < 0).any()) or bool((patches > pixels.shape[1]).any()):
        row = _first_row((grid < 0).any(-1) | (patches > pixels.shape[1])[:, None])
        raise BatchError(f"{where}: row {row}'s image grids {grid[row].tolist()} need {int(patches[row])} patches but "
                         f"pixel_values holds {pixels.shape[1]} a row (or a grid is negative)",
                         fix="build the images with rlgraph.backends.local.vlm.vl_prompts (it pads each row's patches)")


def _pad_images(parts: Sequence[Any]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The parts' images, rows in order, padded to the widest K and I (a part without images has none)."""
    held = [part for part in parts if part.image_grid_thw is not None]
    if not held:
        return None, None
    width = max(part.pixel_values.shape[1] for part in held)
    depth = held[0].pixel_values.shape[2]
    count = max(part.image_grid_thw.shape[1] for part in held)
    pixels, grids = [], []
    for part in parts:
        rows = len(part)
        if part.image_grid_thw is None:
            pixels.append(held[0].pixel_values.new_zeros(rows, width, depth))  # [R, K, D]
            grids.append(held[0].image_grid_thw.new_zeros(rows, count, 3))  # [R, I, 3]
            continue
        pixels.append(torch.nn.functional.pad(part.pixel_values, (0, 0, 0, width - part.pixel_values.shape[1])))
        grids.append(torch.nn.functional.pad(part.image_grid_thw, (0, 0, 0, count - part.image_grid_thw.shape[1])))
    return torch.cat(pixels), torch.cat(grids)


def _rows_of(value: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
    return None if value is None else value[index.to(value.device)]


def _positions(prompts: Prompts) -> torch.Tensor:
    return torch.arange(prompts.ids.shape[0] if prompts.ids.dim() else 0, device=prompts.ids.device)


# Rollouts made from checked Rollouts (rows selected, responses padded, parts concatenated, a device
# move) skip the value checks: each costs host syncs, and a training step makes ~10 such batches.
_DERIVED: contextvars.ContextVar[bool] = contextvars.ContextVar("rlgraph_derived_rollouts", default=False)


@contextlib.contextmanager
def _derived() -> Iterator[None]:
    token = _DERIVED.set(True)
    try:
        yield
    finally:
        _DERIVED.reset(token)


def _first_row(bad: torch.Tensor) -> int:
    """The first row with a True in `bad` [R, ...]."""
    return int(bad.reshape(bad.shape[0], -1).any(dim=1).nonzero()[0])


def _check_rollout_values(rollouts: Rollouts) -> None:
    """What every consumer of a Rollouts assumes: bool masks, group ids >= 0, and finite sampling
    log-probs at real tokens (a NaN or inf there becomes an inf ratio exp(lp - old) and NaN weights).

    Policy: refused, naming the sample; masked (padding) positions may hold anything.
    """
    for name in ("mask", "prompt_mask"):
        if getattr(rollouts, name).dtype != torch.bool:
            raise BatchError(f"Rollouts.{name} is {getattr(rollouts, name).dtype}; masks are bool (True = a real token)",
                             fix=f"pass {name}.bool()")
    group = rollouts.group
    if group.dtype.is_floating_point or group.dtype == torch.bool or group.dim() != 1:
        raise BatchError(f"Rollouts.group must be i64[N] (each rollout's prompt index), got {group.dtype} {tuple(group.shape)}",
                         fix="pass torch.arange(B).repeat_interleave(n) for n samples of each of B prompts")
    if group.is_meta or rollouts.logprobs.is_meta:
        return  # meta tensors (shapes without data) have no values to check
    if len(group) and bool((group < 0).any()):
        row = int((group < 0).nonzero()[0])
        raise BatchError(f"Rollouts.group holds a negative id {int(group[row])} at sample {row}; group ids are prompt indices >= 0",
                         fix="number the prompts 0, 1, ... (rows of one prompt share its id)")
    if rollouts.context_mask is not None and bool((rollouts.mask & ~rollouts.context_mask).any()):
        row = _first_row(rollouts.mask & ~rollouts.context_mask)
        raise BatchError(f"Rollouts: sample {row} trains on a token its context_mask leaves out; the policy's tokens "
                         "(mask) are part of the context", fix="set context_mask = mask | observation tokens")
    bad = rollouts.mask & ~torch.isfinite(rollouts.logprobs)  # [N, T]
    if bool(bad.any()):
        row = _first_row(bad)
        token = int(bad[row].nonzero()[0])
        raise BatchError(
            f"Rollouts.logprobs is {float(rollouts.logprobs[row, token])} at sample {row}, token {token}, a real token "
            "(mask True); the loss's ratio exp(lp - logprobs) would be inf or NaN there",
            fix="give the sampling log-prob of every unmasked token (finite; 0 for demonstrations), or mask the token "
            "out if it is padding",
        )


def check_token_ids(batch: Prompts | Rollouts, vocab_size: int, where: str) -> None:
    """Refuse token ids outside 0..vocab_size-1 before they reach an embedding (a bare IndexError on
    CPU, a device-side assert on GPU), naming the field and the sample."""
    fields = ("ids",) if isinstance(batch, Prompts) else ("prompt_ids", "response_ids")
    for name in fields:
        ids = getattr(batch, name)
        if ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise BatchError(f"{where}: {type(batch).__name__}.{name} is {ids.dtype}, not token ids",
                             fix="pass the tokenizer's integer ids (torch.long)")
        outside = (ids < 0) | (ids >= vocab_size)  # like ids
        if ids.numel() and bool(outside.any()):
            row = _first_row(outside)
            found = ids[row][outside[row]].tolist()
            raise BatchError(f"{where}: {type(batch).__name__}.{name} of sample {row} holds token ids {found[:5]} outside "
                             f"the model's vocabulary 0..{vocab_size - 1}",
                             fix="tokenize with the model's own tokenizer, whose vocabulary matches the embedding")


@attrs.frozen
class Prompts:
    """A batch of B prompts: `ids` i64[B,P] left-padded, `mask` bool[B,P], per-prompt `meta`.

    `index` i64[B] is each prompt's position in the batch the controller built (default
    0..B-1). It is the prompt's identity for sampling: a data-parallel shard keeps it, so a
    prompt draws the same samples whichever rank generates it.

    A vision-language batch adds each row's images: `pixel_values` f32[B, K, D] (the row's image
    patches, zero-padded to K) and `image_grid_thw` i64[B, I, 3] (their grids; zero rows pad). Per
    row, like every other field, so shards, moves and selections carry them unchanged.
    """

    ids: torch.Tensor
    mask: torch.Tensor
    meta: Meta = attrs.field(factory=dict)
    index: torch.Tensor = attrs.field(default=attrs.Factory(_positions, takes_self=True))
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None

    def __attrs_post_init__(self) -> None:
        if self.ids.shape != self.mask.shape or self.ids.dim() != 2:
            raise BatchError(f"Prompts: ids {tuple(self.ids.shape)} and mask {tuple(self.mask.shape)} must both be [B, P]")
        rows = self.ids.shape[0]
        if self.index.dtype != torch.long or tuple(self.index.shape) != (rows,):
            raise BatchError(
                f"Prompts: index must be i64[B] with B={rows} (each prompt's position in the controller's batch), "
                f"got {self.index.dtype} {tuple(self.index.shape)}; leave it out for 0..B-1, or keep it with `select`"
            )
        _check_meta(self.meta, rows, "Prompts")
        _check_images(self, rows)

    def __len__(self) -> int:
        return self.ids.shape[0]

    def select(self, index: Sequence[int] | torch.Tensor) -> Prompts:
        """Rows `index`; each keeps its `index` value (its sampling identity) and its images."""
        index = torch.as_tensor(index, dtype=torch.long)
        return Prompts(self.ids[index], self.mask[index], _take(self.meta, index.tolist()), self.index[index],
                       _rows_of(self.pixel_values, index), _rows_of(self.image_grid_thw, index))


@attrs.frozen
class Rollouts:
    """N = B*n sampled (or demonstrated) responses with everything the loss needs.

    prompt_ids i64[N,P], prompt_mask bool[N,P], response_ids i64[N,T], mask bool[N,T],
    logprobs f32[N,T] (sampling log-probs; zeros for demonstrations), group i64[N].

    `context_mask` bool[N,T] (multi-turn rollouts, `rg.rollout`): the response tokens the model
    reads, the policy's and the environment's observations; `mask` marks only the policy's, the
    tokens trained on. None (single-turn) means `mask`. A forward over the rollouts attends to
    `attention_mask`, so an observation is context for the tokens after it, never a target.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    mask: torch.Tensor
    logprobs: torch.Tensor
    group: torch.Tensor
    meta: Meta = attrs.field(factory=dict)
    context_mask: torch.Tensor | None = None
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None

    def __attrs_post_init__(self) -> None:
        rows = self.response_ids.shape[0]
        if self.context_mask is not None and (self.context_mask.shape != self.mask.shape
                                              or self.context_mask.dtype != torch.bool):
            raise BatchError(f"Rollouts.context_mask must be bool [N, T] like mask {tuple(self.mask.shape)}, got "
                             f"{self.context_mask.dtype} {tuple(self.context_mask.shape)}")
        for name in ("prompt_ids", "prompt_mask", "response_ids", "mask", "logprobs", "group"):
            value = getattr(self, name)
            if value.shape[0] != rows:
                raise BatchError(f"Rollouts.{name} has {value.shape[0]} rows, expected N={rows}")
        if self.mask.shape != self.response_ids.shape or self.logprobs.shape != self.response_ids.shape:
            raise BatchError(
                "Rollouts: response_ids, mask and logprobs must share [N, T]; got "
                f"{tuple(self.response_ids.shape)}, {tuple(self.mask.shape)}, {tuple(self.logprobs.shape)}"
            )
        _check_meta(self.meta, rows, "Rollouts")
        _check_images(self, rows)
        if not _DERIVED.get():  # rows taken, padded or moved from checked rollouts keep their values
            _check_rollout_values(self)

    def __len__(self) -> int:
        return self.response_ids.shape[0]

    @property
    def attention_mask(self) -> torch.Tensor:
        """bool[N,T]: the response tokens a forward attends to (`context_mask`, else `mask`)."""
        return self.mask if self.context_mask is None else self.context_mask

    def select(self, index: Sequence[int] | torch.Tensor) -> Rollouts:
        """Rows `index` (for mini/micro-batching and data-parallel scatter)."""
        index = torch.as_tensor(index, dtype=torch.long)
        with _derived():
            return Rollouts(
                self.prompt_ids[index], self.prompt_mask[index], self.response_ids[index], self.mask[index],
                self.logprobs[index], self.group[index], _take(self.meta, index.tolist()),
                None if self.context_mask is None else self.context_mask[index],
                _rows_of(self.pixel_values, index), _rows_of(self.image_grid_thw, index),
            )

    def pad_responses(self, steps: int, *, pad_id: int = 0) -> Rollouts:
        """The same rollouts with responses right-padded to `steps` tokens (mask False, log-prob 0)."""
        if steps < self.response_ids.shape[1]:
            raise ValueError(f"Rollouts.pad_responses: responses have {self.response_ids.shape[1]} tokens, more than {steps}")
        if steps == self.response_ids.shape[1]:
            return self
        with _derived():  # the added columns are masked out
            context = None if self.context_mask is None else _pad(self.context_mask, steps, False)
            return attrs.evolve(self, response_ids=_pad(self.response_ids, steps, pad_id), context_mask=context,
                                mask=_pad(self.mask, steps, False), logprobs=_pad(self.logprobs, steps, 0.0))

    @staticmethod
    def concat(parts: Sequence[Rollouts], *, pad_id: int = 0) -> Rollouts:
        """The rows of `parts`, in order, as one batch.

        Responses are right-padded to the longest T and prompts left-padded to the longest P
        (padding has mask False, log-prob 0 and id `pad_id`). Group ids are renumbered 0, 1, ...
        in order of first appearance, and groups of different parts never merge, so concatenating
        whole contiguous groups gives contiguous ids. Every part must carry the same meta fields.
        """
        if not parts:
            raise ValueError("Rollouts.concat: need at least one batch")
        keys = list(parts[0].meta)
        for part in parts[1:]:
            if set(part.meta) != set(keys):
                raise ValueError(f"Rollouts.concat: meta fields differ: {sorted(keys)} vs {sorted(part.meta)}")
        steps = max(part.response_ids.shape[1] for part in parts)
        width = max(part.prompt_ids.shape[1] for part in parts)
        groups, offset = [], 0
        for part in parts:
            groups.append(_first_appearance(part.group) + offset)  # [R]
            offset += len(torch.unique(part.group))
        with _derived():  # checked parts, their padding masked out
            return Rollouts(
            torch.cat([_pad(part.prompt_ids, width, pad_id, left=True) for part in parts]),          # [N, P]
            torch.cat([_pad(part.prompt_mask, width, False, left=True) for part in parts]),          # [N, P]
            torch.cat([_pad(part.response_ids, steps, pad_id) for part in parts]),                  # [N, T]
            torch.cat([_pad(part.mask, steps, False) for part in parts]),                           # [N, T]
            torch.cat([_pad(part.logprobs, steps, 0.0) for part in parts]),                         # [N, T]
            torch.cat(groups),                                                                      # [N]
            {key: [value for part in parts for value in part.meta[key]] for key in keys},
            _concat_context(parts, steps),
            *_pad_images(parts),
            )

    @staticmethod
    def from_demonstrations(prompts: Prompts, response_ids: torch.Tensor, mask: torch.Tensor) -> Rollouts:
        """Teacher-forcing batch for SFT: one response per prompt, sampling log-probs zero."""
        rows = len(prompts)
        return Rollouts(
            prompts.ids, prompts.mask, response_ids, mask.bool(),
            torch.zeros(response_ids.shape, dtype=torch.float32), torch.arange(rows), dict(prompts.meta),
            pixel_values=prompts.pixel_values, image_grid_thw=prompts.image_grid_thw,
        )


def _concat_context(parts: Sequence[Rollouts], steps: int) -> torch.Tensor | None:
    """The parts' context masks [N, T] (a part without one reads its `mask`); None when none has one."""
    if all(part.context_mask is None for part in parts):
        return None
    return torch.cat([_pad(part.attention_mask, steps, False) for part in parts])  # [N, T]


def check_batch(batch: Any, kind: str, program: str) -> None:
    """Refuse running `program` on anything but the record (`kind`: "Prompts" or "Rollouts") its
    algorithm's signature names, before a primitive fails on a missing field."""
    if isinstance(batch, {"Prompts": Prompts, "Rollouts": Rollouts}[kind]):
        return
    fix = {"Prompts": "run it on Prompts (to_prompts(rows, tokenizer), or Prompts(ids, mask)); it generates its own "
                      "rollouts. To train on given rollouts, use an algorithm whose batch is `ro: rg.Rollouts`",
           "Rollouts": "run it on Rollouts (Rollouts.from_demonstrations(prompts, response_ids, mask) for SFT), or use "
                       "an algorithm over `prompts: rg.Prompts` that generates them"}[kind]
    raise BatchError(f"{program} takes {kind} as its batch, got {type(batch).__name__}", fix=fix)


def to_device(value: Any, device: torch.device | str) -> Any:
    """`value` with its tensors on `device`: a tensor, a `Prompts` or `Rollouts`, or a tuple, list or
    dict of them; anything else is returned as is. A tensor already on `device` is not copied.

    The one device move of the runtime: workers (`Worker.put/get`), executors (a primitive's inputs
    to its device and its outputs back) and the eager interpreter all use it.

    >>> to_device((torch.zeros(2), "meta"), "cpu")[1]
    'meta'
    """
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (Prompts, Rollouts)):
        tensors = {field.name: getattr(value, field.name) for field in attrs.fields(type(value))}
        with _derived():  # the same values on another device: checked where they were made
            return attrs.evolve(value, **{name: tensor.to(device) for name, tensor in tensors.items()
                                          if isinstance(tensor, torch.Tensor)})
    if type(value) in (tuple, list):  # not namedtuples: their fields are positional arguments
        return type(value)(to_device(item, device) for item in value)
    if type(value) is dict:
        return {key: to_device(item, device) for key, item in value.items()}
    return value
