"""A checkpoint written in parts: each FSDP2 rank saves its own rows, nobody gathers the whole.

A full checkpoint (`rlgraph.train.checkpoint`) holds each role's whole weights in one file; on
spmd/Ray building it means gathering the state on one rank and pickling it to the controller: a
full fp32 copy of the weights and of the optimizer state in two processes, the run's memory peak.
In parts, a role sharded over `m` ranks is `m` files, part k holding the rows torch.chunk gives
shard position k (FSDP2's dim-0 sharding) of every tensor (a tensor that is not sharded is kept
whole in part 0), and `m` optimizer files, each rank's own optimizer state:

    policy.part-0-of-2.safetensors   policy.optim.part-0-of-2.pt
    policy.part-1-of-2.safetensors   policy.optim.part-1-of-2.pt

Reading takes any rows of any tensor from the parts that cover them (`read_rows`, lazily through
safetensors' slices), so a checkpoint written by 2 ranks loads on 4, on 1, or whole
(`read_full`, for the local runtime and `rlgraph export`). Only the rows a rank holds are read.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rlgraph.backends.protocols import ExecutorState, RoleState


def part_file(role: str, part: int, parts: int) -> str:
    return f"{role}.part-{part}-of-{parts}.safetensors"


def optimizer_file(role: str, part: int, parts: int) -> str:
    return f"{role}.optim.part-{part}-of-{parts}.pt"


def chunk_rows(rows: int, part: int, parts: int) -> tuple[int, int]:
    """[start, stop) of dim 0 that torch.chunk(rows, parts) gives chunk `part` (empty past the last chunk)."""
    size = -(-rows // parts) if rows else 0
    start = min(part * size, rows)
    return start, min(start + size, rows)


def untied(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors sharing memory (tied embeddings, a tied shard): the later names
    get their own copies."""
    seen: set[int] = set()
    out = {}
    for name, value in tensors.items():
        out[name] = value.clone() if value.numel() and value.data_ptr() in seen else value
        seen.add(value.data_ptr())
    return out


def write_part(directory: Path, role: str, part: int, parts: int, rows: Mapping[str, torch.Tensor],
               whole: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, ...]]) -> Path:
    """Save part `part` of `parts` of `role`: `rows` (this position's rows of each sharded tensor) and,
    in part 0 only, the unsharded tensors `whole`; `shapes` are the full shapes of every tensor."""
    tensors = {name: value.detach().cpu().contiguous() for name, value in rows.items()}
    if part == 0:
        tensors.update({name: value.detach().cpu().contiguous() for name, value in whole.items()})
    tensors = untied(tensors)
    file = directory / part_file(role, part, parts)
    save_file(tensors, str(file), metadata={"shapes": json.dumps({k: list(v) for k, v in shapes.items()}),
                                            "whole": json.dumps(sorted(whole))})
    return file


def _layout(directory: Path, role: str, parts: int) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """(full shape of every tensor, the names kept whole in part 0), from part 0's header."""
    with safe_open(str(directory / part_file(role, 0, parts)), framework="pt") as handle:
        meta = handle.metadata() or {}
    return {k: tuple(v) for k, v in json.loads(meta["shapes"]).items()}, set(json.loads(meta["whole"]))


def tensor_names(directory: Path, role: str, parts: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of `role` in the checkpoint, with its full shape."""
    return _layout(directory, role, parts)[0]


def read_rows(directory: Path, role: str, parts: int,
              wanted: Mapping[str, tuple[int, int] | None]) -> dict[str, torch.Tensor]:
    """For each tensor name in `wanted`, rows (start, stop) of its dim 0, or all of it (None), read
    from the parts that hold them (a tensor kept whole in part 0 is sliced there)."""
    shapes, whole = _layout(directory, role, parts)
    pieces: dict[str, list[torch.Tensor]] = {name: [] for name in wanted}
    for part in range(parts):
        with safe_open(str(directory / part_file(role, part, parts)), framework="pt") as handle:
            for name, span in wanted.items():
                if name in whole:
                    if part == 0:
                        tensor = handle.get_tensor(name)
                        pieces[name].append(tensor if span is None else tensor[span[0]:span[1]])
                    continue
                first, last = chunk_rows(shapes[name][0], part, parts)
                low, high = (first, last) if span is None else (max(span[0], first), min(span[1], last))
                if low < high:
                    pieces[name].append(handle.get_slice(name)[low - first:high - first])
                elif part == 0:  # no rows here, but an empty slice carries the dtype and the trailing dims
                    pieces[name].append(handle.get_slice(name)[0:0])
    return {name: found[0] if len(found) == 1 else torch.cat(found) for name, found in pieces.items()}


def read_full(directory: Path, role: str, parts: int) -> dict[str, torch.Tensor]:
    """Every tensor of `role`, whole (the parts concatenated)."""
    return read_rows(directory, role, parts, dict.fromkeys(tensor_names(directory, role, parts)))


def refuse_non_finite(tensors: Mapping[str, torch.Tensor], role: str, where: str) -> None:
    """NaN/inf weights would train on as a 'gradient norm is nan' steps later: refuse them at load."""
    from rlgraph.backends.local.state import CheckpointMismatch

    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            count = int((~torch.isfinite(tensor)).sum())
            raise CheckpointMismatch(f"{where}: role {role!r} tensor {name!r} holds {count} non-finite value(s) (NaN/inf) "
                                     f"of {tensor.numel()}; the checkpoint is damaged or the run diverged before it was "
                                     "saved, so it is not loaded")


def read_optimizer_part(directory: Path, role: str, part: int, parts: int) -> dict[str, Any]:
    return torch.load(directory / optimizer_file(role, part, parts), weights_only=True, map_location="cpu")


def read_full_optimizer(directory: Path, role: str, parts: int) -> dict[str, Any]:
    """The whole optimizer state of `role` from its parts (see `merge_optimizer_states`)."""
    return merge_optimizer_states([read_optimizer_part(directory, role, part, parts) for part in range(parts)])


def merge_optimizer_states(parts: list[Mapping[str, Any]]) -> dict[str, Any]:
    """The full optimizer state dict from the ranks' shard states, in shard order (dim-0 shards
    concatenate; scalars such as `step` are the same on every rank)."""
    state = {}
    for index, entries in parts[0]["state"].items():
        state[index] = {key: torch.cat([part["state"][index][key] for part in parts])
                        if isinstance(value, torch.Tensor) and value.dim() > 0 else value
                        for key, value in entries.items()}
    return {"state": state, "param_groups": parts[0]["param_groups"]}


def full_state(directory: Path, roles: Mapping[str, Mapping[str, Any]], shuffle_rng: Any,
               sampling: Mapping[str, Any]) -> ExecutorState:
    """The whole `ExecutorState` of a checkpoint in parts (`roles`: its meta, role -> version,
    optimizer kind, part count): what one process needs to hold every role."""
    state = {}
    for role, held in roles.items():
        parts = held["parts"]
        optimizer = read_full_optimizer(directory, role, parts) if held.get("optimizer") else None
        state[role] = RoleState(read_full(directory, role, parts), optimizer, held.get("optimizer"), held["version"])
    return ExecutorState(state, shuffle_rng, dict(sampling))


def check_parts(directory: Path, role: str, parts: int) -> None:
    """Refuse non-finite values in any part of `role`, one part file in memory at a time."""
    from safetensors.torch import load_file

    for part in range(parts):
        file = directory / part_file(role, part, parts)
        refuse_non_finite(load_file(str(file)), role, f"checkpoint file {file}")
