"""What each collective of a plan does to the data, simulated over per-rank shards in one process.

The `reshard` pass gives every value a layout (`rlgraph.plan.layouts`): `("controller",)`, or
`(ranks, split)` where a per-row value is cut into `split` contiguous row shards
(`torch.tensor_split` order) and a value that is not per-row is replicated (`split` 1). The `split` data-parallel replicas are consecutive
blocks of `len(ranks) // split` ranks; the ranks of a block (tensor-parallel peers) hold the same
rows. This module is the reference a multi-process runtime must agree with:

    placed = shard(value, src)                       # {rank or "controller": piece}
    placed, sent = move(placed, src, dst, kind)      # one collective; `sent` bytes crossed
    value == unshard(placed, dst)                    # nothing lost, nothing duplicated

`move` assembles each destination shard from the row ranges the source shards hold, which is
what scatter, gather, all_to_all and send_recv do; it refuses a collective kind that does not fit
the two layouts, so a plan that names the wrong collective fails here.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from rlgraph.batches import Prompts, Rollouts
from rlgraph.errors import RLGraphError
from rlgraph.plan.layouts import CONTROLLER, Layout, collective_kind


class CollectiveError(RLGraphError):
    """A collective that cannot move a value between the two layouts it names."""


def _tensor_fields(record: Any) -> list[str]:
    return [f.name for f in attrs.fields(type(record)) if isinstance(getattr(record, f.name), torch.Tensor)]


def _is_record(value: Any) -> bool:
    return isinstance(value, (Prompts, Rollouts))


def _rows(value: Any) -> int | None:
    if _is_record(value):
        return len(value)
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        return value.shape[0]
    return None


def _take(value: Any, start: int, stop: int) -> Any:
    if isinstance(value, Rollouts):
        piece = value.select(range(start, stop))
        return attrs.evolve(piece, group=local_groups([piece.group]))
    if _is_record(value):
        return value.select(range(start, stop))
    return value[start:stop]


def local_groups(pieces: list[torch.Tensor]) -> torch.Tensor:
    """The group ids of rows cut into `pieces` (in order), numbered 0, 1, ... by first appearance,
    a piece's groups never merging with another's.

    Group ids are local to the value that holds them: a shard numbers its own groups from 0 (the
    group estimators size their buffers by the shard's rows), and a gather renumbers the shards'
    groups into one sequence. Shards must hold whole groups (the runner checks B divides evenly).
    """
    from rlgraph.batches import _first_appearance

    out, offset = [], 0
    for group in pieces:
        if len(group):
            out.append(_first_appearance(group) + offset)
            offset = int(out[-1].max()) + 1
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


def _cat(pieces: list[Any]) -> Any:
    if isinstance(pieces[0], Rollouts):
        return Rollouts.concat(pieces)  # pads shards' responses to one T, renumbers their groups
    if _is_record(pieces[0]):
        tensors = {name: torch.cat([getattr(p, name) for p in pieces]) for name in _tensor_fields(pieces[0])}
        meta = {key: [v for piece in pieces for v in piece.meta[key]] for key in pieces[0].meta}
        return type(pieces[0])(**tensors, meta=meta)
    return torch.cat(pieces)


def _nbytes(value: Any) -> int:
    if _is_record(value):
        return sum(_nbytes(getattr(value, name)) for name in _tensor_fields(value))
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def _bounds(rows: int, parts: int) -> list[tuple[int, int]]:
    """Row ranges of `parts` contiguous shards, as `torch.tensor_split` cuts them."""
    sizes = [len(chunk) for chunk in torch.tensor_split(torch.arange(rows), parts)]
    starts = [sum(sizes[:i]) for i in range(parts)]
    return [(start, start + size) for start, size in zip(starts, sizes)]


def shard_index(layout: Layout, position: int) -> int:
    """Which data-parallel shard the rank at `position` within the layout's ranks holds."""
    ranks, split = layout
    return position // (len(ranks) // split)


def _check_layout(layout: Layout) -> None:
    if layout == (CONTROLLER,):
        return
    ranks, split = layout
    if not ranks or split < 1 or len(ranks) % split:
        raise CollectiveError(f"layout {layout}: {len(ranks)} rank(s) cannot hold {split} data-parallel shard(s)")


def shard(value: Any, layout: Layout) -> dict[Any, Any]:
    """`value` as it lives in `layout`: whole on the controller, row shards or replicas on ranks."""
    _check_layout(layout)
    if layout == (CONTROLLER,):
        return {CONTROLLER: value}
    ranks, split = layout
    rows = _rows(value)
    if rows is None or split == 1:
        return {rank: value for rank in ranks}
    bounds = _bounds(rows, split)
    return {rank: _take(value, *bounds[shard_index(layout, i)]) for i, rank in enumerate(ranks)}


def unshard(placed: dict[Any, Any], layout: Layout) -> Any:
    """The whole value from its shards; replicas must agree (a disagreement is a bug upstream)."""
    if layout == (CONTROLLER,):
        return placed[CONTROLLER]
    ranks, split = layout
    first_of_shard: dict[int, Any] = {}
    for i, rank in enumerate(ranks):
        index = shard_index(layout, i)
        if index in first_of_shard and not _same(first_of_shard[index], placed[rank]):
            raise CollectiveError(f"replicas of shard {index} disagree on rank {rank}")
        first_of_shard.setdefault(index, placed[rank])
    pieces = [first_of_shard[i] for i in range(split)]
    return pieces[0] if _rows(pieces[0]) is None or split == 1 else _cat(pieces)


def _same(a: Any, b: Any) -> bool:
    if _is_record(a):
        return type(a) is type(b) and all(torch.equal(getattr(a, f), getattr(b, f)) for f in _tensor_fields(a))
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


# The one collective that moves a value from one layout to another: the plan's rule, which the reshard pass applies.
expected_kind = collective_kind


def move(placed: dict[Any, Any], src: Layout, dst: Layout, kind: str, *, per_row: bool | None = None) -> tuple[dict[Any, Any], int]:
    """Run collective `kind` from `src` to `dst`; returns the new placement and the bytes sent
    (rows that change data-parallel shard, counted once per destination shard).

    `per_row` says whether the value is split by rows where a layout splits (default: it has a
    leading dim); it decides scatter against broadcast, as in the reshard pass.
    """
    _check_layout(src)
    _check_layout(dst)
    if src == dst:
        raise CollectiveError(f"{kind} from {_show(src)} to the same layout: the plan moves a value that is already there")
    whole = unshard(placed, src)
    rows = _rows(whole)
    per_row = rows is not None if per_row is None else per_row
    wanted = expected_kind(src, dst, per_row)
    if kind != wanted:
        raise CollectiveError(f"{kind} cannot move a value from {_show(src)} to {_show(dst)}; that is a {wanted}")
    out = shard(whole, dst)
    if rows is None:
        return out, _nbytes(whole)
    return out, _moved_bytes(whole, rows, src, dst)


def _moved_bytes(whole: Any, rows: int, src: Layout, dst: Layout) -> int:
    row_bytes = _nbytes(whole) // max(rows, 1)
    if src == (CONTROLLER,) or dst == (CONTROLLER,) or set(src[0]) != set(dst[0]):
        return _nbytes(whole)
    # all_to_all on one rank set: a destination shard receives the rows no rank of it already holds.
    src_bounds, dst_bounds = _bounds(rows, src[1]), _bounds(rows, dst[1])
    holds = {rank: src_bounds[shard_index(src, i)] for i, rank in enumerate(src[0])}
    sent = 0
    for index, (start, stop) in enumerate(dst_bounds):
        members = [rank for i, rank in enumerate(dst[0]) if shard_index(dst, i) == index]
        local = max((max(0, min(stop, holds[r][1]) - max(start, holds[r][0])) for r in members), default=0)
        sent += (stop - start - local) * row_bytes
    return sent


def _show(layout: Layout) -> str:
    if layout == (CONTROLLER,):
        return CONTROLLER
    ranks, split = layout
    return f"ranks {list(ranks)} split {split}"
