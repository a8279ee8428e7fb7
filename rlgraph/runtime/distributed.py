"""The plan's collectives for real: point-to-point messages between the processes of a torch.distributed job.

Process `i` of the group plays mesh rank `i`; one process (`controller`, default 0) also plays the
controller. Every process taking part in a move calls `move_distributed` with the piece it holds
under the source layout (None if it holds none) and gets back the piece it must hold under the
destination layout, exactly `collectives.shard(value, dst)[its rank]`:

    piece, sent = move_distributed(mine, ((0, 1), 2), ("controller",), "gather", per_row=True)

The layouts and their arithmetic are those of `rlgraph.runtime.collectives` (the simulation this
module is tested against): `route` works out, identically on every process, which rows each
process sends to which, and `move_distributed` posts those sends and receives (`isend`/`irecv`,
gloo on CPU; NCCL takes the same code with CUDA tensors). A process keeps the rows it already
holds, so an all_to_all moves only rows a destination process lacks.

Shapes: a receiver learns the row count, dtypes and trailing shapes from a small header (a pickled
message) that the first process of the source layout sends to every other process of the move
before the data, after collecting the row count of each source shard; callers pass nothing but the
layouts. (A runner that knows the specs could skip this round trip; it is small next to the data.) Records (`Prompts`, `Rollouts`) move
field by field; their `meta` lists are not sent (records arrive with `meta={}`; keep per-row
metadata on the controller).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.distributed as dist

from rlgraph.batches import Prompts, Rollouts
from rlgraph.runtime import collectives as C

_RECORDS = {cls.__name__: cls for cls in (Prompts, Rollouts)}


@attrs.frozen
class Piece:
    """Rows [start, stop) of the value that process `dest` gets from process `source`."""

    source: int
    dest: int
    start: int
    stop: int

    @property
    def local(self) -> bool:
        return self.source == self.dest


@attrs.frozen
class Header:
    """What a receiver must know to allocate its buffers: the record type (None for a tensor),
    the value's rows (None when it has no leading dim and is replicated whole), and each tensor
    field's name, dtype and shape after the rows."""

    record: str | None
    rows: int | None
    fields: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]


# -- where the rows are: the same for every process --------------------------------------------------


def _process(layout: C.Layout, rank: Any, controller: int) -> int:
    return controller if layout == (C.CONTROLLER,) else rank


def holdings(layout: C.Layout, rows: int | None, controller: int = 0) -> list[tuple[tuple[int, int], list[int]]]:
    """Each shard of `layout` in row order: its row range and the processes that hold it.

    A value without rows (`rows` None) is one unsplittable unit: range (0, 1), held whole by every
    shard, as `collectives.shard` replicates it.
    """
    if layout == (C.CONTROLLER,):
        return [((0, 1 if rows is None else rows), [controller])]
    ranks, split = layout
    if rows is None:
        return [((0, 1), list(ranks))]
    shards = [(bounds, []) for bounds in C._bounds(rows, split)]
    for position, rank in enumerate(ranks):
        shards[C.shard_index(layout, position)][1].append(rank)
    return shards


def route(src: C.Layout, dst: C.Layout, rows: int | None, controller: int = 0) -> list[Piece]:
    """Every piece of rows the move from `src` to `dst` delivers, in row order per destination.

    Guarantees: each destination process gets exactly the rows of its `dst` shard, each row once;
    rows it already holds under `src` are kept (a local piece, nothing sent); other rows come from
    one holder of their `src` shard, chosen round-robin over the replicas to spread the load.
    """
    sources = holdings(src, rows, controller)
    pieces = []
    for (start, stop), members in holdings(dst, rows, controller):
        for position, dest in enumerate(members):
            for (have_start, have_stop), holders in sources:
                lo, hi = max(start, have_start), min(stop, have_stop)
                if lo >= hi:
                    continue
                source = dest if dest in holders else holders[position % len(holders)]
                pieces.append(Piece(source, dest, lo, hi))
    return pieces


def _range_of(layout: C.Layout, rows: int | None, process: int, controller: int) -> tuple[int, int] | None:
    for bounds, members in holdings(layout, rows, controller):
        if process in members:
            return bounds
    return None


def _processes(layout: C.Layout, controller: int) -> list[int]:
    return [controller] if layout == (C.CONTROLLER,) else list(layout[0])


# -- values as lists of row-major tensor fields ------------------------------------------------------


def header_of(value: Any) -> Header:
    """The header describing `value` (a tensor, `Prompts` or `Rollouts`)."""
    if C._is_record(value):
        names = C._tensor_fields(value)
        fields = tuple((name, getattr(value, name).dtype, tuple(getattr(value, name).shape[1:])) for name in names)
        return Header(type(value).__name__, len(value), fields)
    if not isinstance(value, torch.Tensor):
        raise C.CollectiveError(f"move_distributed moves tensors and Prompts/Rollouts records, not {type(value).__name__}")
    if value.dim() == 0:
        return Header(None, None, (("value", value.dtype, ()),))
    return Header(None, value.shape[0], (("value", value.dtype, tuple(value.shape[1:])),))


def _fields(value: Any, header: Header) -> list[torch.Tensor]:
    """The value's tensors, each with a leading row dim (a 0-dim tensor becomes one row)."""
    if header.record is not None:
        return [getattr(value, name) for name, _, _ in header.fields]
    return [value if header.rows is not None else value.reshape(1)]


def _assemble(header: Header, fields: list[torch.Tensor]) -> Any:
    if header.record is not None:
        return _RECORDS[header.record](**{name: t for (name, _, _), t in zip(header.fields, fields)}, meta={})
    return fields[0] if header.rows is not None else fields[0].reshape(())


# -- the move ----------------------------------------------------------------------------------------


def _check(src: C.Layout, dst: C.Layout, kind: str, per_row: bool, controller: int, world: int) -> None:
    C._check_layout(src)
    C._check_layout(dst)
    if src == dst:
        raise C.CollectiveError(f"{kind} from {C._show(src)} to the same layout: the value is already there")
    wanted = C.expected_kind(src, dst, per_row)
    if kind != wanted:
        raise C.CollectiveError(f"{kind} cannot move a value from {C._show(src)} to {C._show(dst)}; that is a {wanted}")
    outside = sorted({p for layout in (src, dst) for p in _processes(layout, controller) if not 0 <= p < world})
    if outside:
        raise C.CollectiveError(f"mesh rank(s) {outside} have no process: the group has {world}; "
                                "start one process per mesh rank")


def _exchange_header(local: Any, src: C.Layout, dst: C.Layout, me: int, controller: int, group) -> Header:
    """Every process of the move learns the value's header from the first process of `src`.

    No process holds the whole value, so the row count is summed first: the first holder of each
    other source shard sends its shard's rows to the first process, which then sends the header
    (its own fields' dtypes and shapes, the total rows) to every other process of the move.
    """
    first = _processes(src, controller)[0]
    leaders = _shard_leaders(src, controller)
    if me in leaders and me != first:
        dist.send_object_list([C._rows(local)], dst=_peer(first, group), group=group)
    if me == first:
        counts = [C._rows(local)]
        for leader in leaders[1:]:
            box = [None]
            dist.recv_object_list(box, src=_peer(leader, group), group=group)
            counts.append(box[0])
        header = attrs.evolve(header_of(local), rows=None if counts[0] is None else sum(counts))
        for peer in sorted(set(_processes(src, controller) + _processes(dst, controller)) - {first}):
            dist.send_object_list([header], dst=_peer(peer, group), group=group)
        return header
    box = [None]
    dist.recv_object_list(box, src=_peer(first, group), group=group)
    return box[0]


def _shard_leaders(layout: C.Layout, controller: int) -> list[int]:
    """The first process of each data-parallel shard of `layout`, in shard order."""
    if layout == (C.CONTROLLER,):
        return [controller]
    ranks, split = layout
    return list(ranks[::len(ranks) // split])


def _peer(process: int, group) -> int:
    """The global rank of the group's process `process` (torch's point-to-point calls take global ranks)."""
    return process if group is None else dist.get_global_rank(group, process)


def _device(group) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")


def move_distributed(local: Any, src: C.Layout, dst: C.Layout, kind: str, *, per_row: bool,
                     controller: int = 0, group: dist.ProcessGroup | None = None) -> tuple[Any, int]:
    """Run collective `kind` from `src` to `dst` across the processes of `group` (default: the world).

    Every process of `src` and `dst` must call it with the same arguments but `local`: its piece
    under `src`, None if it holds none. Returns the piece it holds under `dst` (None if none) and
    the payload bytes it sent (header and locally kept rows excluded). A process in neither layout
    may call it too; it returns (None, 0) at once. A wrong `kind`, equal layouts or a mesh rank
    without a process raise `CollectiveError` on every process before any message is sent.
    """
    me, world = dist.get_rank(group), dist.get_world_size(group)
    _check(src, dst, kind, per_row, controller, world)
    involved = set(_processes(src, controller)) | set(_processes(dst, controller))
    if me not in involved:
        return None, 0
    held = me in _processes(src, controller)
    if held and local is None:
        raise C.CollectiveError(f"process {me} is in the source layout {C._show(src)} but passed no value")
    header = _exchange_header(local, src, dst, me, controller, group)
    pieces = route(src, dst, header.rows, controller)
    mine = _fields(local, header) if held else []
    have = _range_of(src, header.rows, me, controller)
    ops, received, sent, device = [], {}, 0, _device(group)
    for piece in pieces:
        if piece.local:
            continue
        for tag, (_, dtype, shape) in enumerate(header.fields):
            if piece.source == me:
                rows = mine[tag][piece.start - have[0]:piece.stop - have[0]].contiguous()
                ops.append(dist.P2POp(dist.isend, rows, _peer(piece.dest, group), group, tag))
                sent += rows.numel() * rows.element_size()
            elif piece.dest == me:
                buffer = torch.empty((piece.stop - piece.start, *shape), dtype=dtype, device=device)
                ops.append(dist.P2POp(dist.irecv, buffer, _peer(piece.source, group), group, tag))
                received[piece, tag] = buffer
    for work in dist.batch_isend_irecv(ops) if ops else ():
        work.wait()
    if me not in _processes(dst, controller):
        return None, sent
    return _collect(header, [p for p in pieces if p.dest == me], mine, have, received, device), sent


def _collect(header: Header, pieces: list[Piece], mine: list[torch.Tensor], have: tuple[int, int] | None,
             received: dict, device: torch.device) -> Any:
    """This process's destination piece from its kept and received rows, in row order."""
    fields = []
    for tag, (name, dtype, shape) in enumerate(header.fields):
        parts = [mine[tag][p.start - have[0]:p.stop - have[0]] if p.local else received[p, tag] for p in pieces]
        if header.record == "Rollouts" and name == "group":
            fields.append(C.local_groups(parts).to(device))  # each piece's groups, renumbered for this shard
            continue
        fields.append(torch.cat(parts) if parts else torch.empty((0, *shape), dtype=dtype, device=device))
    return _assemble(header, fields)
