"""Checkpoints of FSDP2-sharded roles: each rank's part, and the whole state from the parts.

A checkpoint is runtime-independent: full weights and full optimizer states (`ExecutorState`).
Each rank exports its part (`ShardedState.export_state`: the full weights from the group's first
rank, its own optimizer shard); the controller merges the parts (`merge_rank_states`, reached
through `WorldSpec.merge_states`, so the runtime never reads the part format); each rank imports
the whole state and keeps its shards. A LoRA role's part holds the adapters only.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from rlgraph.backends.fsdp.shards import role_module, shard_rows
from rlgraph.backends.local.state import LMWorker, optimizer_kind, check_role_state, checkpoint_weights
from rlgraph.backends.local.counter_sampling import SamplingStream
from rlgraph.backends.protocols import ExecutorState, RoleState
from rlgraph.backends.state_files import (chunk_rows, merge_optimizer_states, optimizer_file, read_full_optimizer,
                                          read_optimizer_part, read_rows, refuse_non_finite, tensor_names,
                                          write_part)
from rlgraph.batches import to_device
from rlgraph.errors import RLGraphError


class ShardedState:
    """The `FSDPExecutor`'s checkpoint commands (a mixin: it reads the executor's `models`,
    `role_groups`, `shard_groups`, `rank`, `generator` and `sampling`)."""

    def full_state(self, role: str, names: set[str] | None = None) -> dict[str, torch.Tensor] | None:
        """`role`'s unsharded state dict (or its tensors `names`) on the CPU; every rank of its group
        calls it, its first rank returns it."""
        if role not in self.models:
            return None
        state = {name: (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu()
                 for name, value in role_module(self.models[role]).state_dict().items() if names is None or name in names}
        first = min(dist.get_process_group_ranks(self.role_groups[role]))
        return state if self.rank == first else None

    def save_weights(self, role: str, path: str) -> str | None:
        """`role`'s full weights (a LoRA role's adapters merged in, in fp32 as the engine gets them) as
        one safetensors file at `path`, written by the first rank of its group; every rank of the group
        calls it (the gather is a collective). Returns the path on the writing rank, else None."""
        from rlgraph.backends.fsdp.loading import write_weights

        state = self.full_state(role)
        if state is None:
            return None
        if role in self.adapters:
            from rlgraph.backends.lora import merge_adapters

            with torch.no_grad():
                state = merge_adapters(state, self.adapters[role])
        return str(write_weights(state, path))

    def _checkpointed(self, role: str) -> set[str]:
        """The tensors a checkpoint keeps of `role`, as the local executor keeps them: all of them, or a
        LoRA role's adapters (its frozen base comes back from the model source), or none for a view."""
        worker = self.models[role]
        return set(checkpoint_weights(LMWorker(role_module(worker), worker.optimizer)))

    # -- checkpoints: this rank's part ------------------------------------------------------------
    def export_state(self) -> dict[str, Any]:
        """This rank's part of a checkpoint: per role, the full weights (from the group's first rank
        only; gathering them is a collective every rank of the group joins), this rank's optimizer
        shard state, its position in the group and the version; plus the random streams."""
        roles = {}
        for role, worker in self.models.items():
            group_ranks = sorted(dist.get_process_group_ranks(self.shard_groups[role]))  # one replica's shards
            roles[role] = {"model": self.full_state(role, self._checkpointed(role)), "group": group_ranks,
                           "version": worker.version,
                           "optimizer": to_device(worker.optimizer.state_dict(), torch.device("cpu"))
                           if worker.optimizer is not None else None,  # the controller may have no GPU
                           "optimizer_kind": optimizer_kind(worker.optimizer)}
        return {"roles": roles, "shuffle_rng": self.generator.get_state(), "sampling": attrs.asdict(self.sampling)}

    def import_state(self, state: ExecutorState, where: str = "the checkpoint") -> None:
        """Load this rank's shards of a full checkpoint state (all or nothing, checked first)."""
        kept = {role: {name: value for name, value in role_module(worker).state_dict().items()
                       if name in self._checkpointed(role)} for role, worker in self.models.items()}
        for role, worker in self.models.items():
            check_role_state(role, kept[role], optimizer_kind(worker.optimizer), state, where)
        for role, worker in self.models.items():
            held, position, ways = state.roles[role], *self._position(role)
            with torch.no_grad():
                for name, param in kept[role].items():
                    target = param.to_local() if isinstance(param, DTensor) else param
                    source = shard_rows(held.model[name], position, ways) if isinstance(param, DTensor) else held.model[name]
                    target.copy_(source.to(target.device, target.dtype))
            if worker.optimizer is not None:
                worker.optimizer.load_state_dict(_shard_optimizer_state(held.optimizer, worker.optimizer.params, position, ways))
            worker.version = held.version
        self.generator.set_state(state.shuffle_rng)
        self.sampling = SamplingStream(**state.sampling)

    # -- checkpoints in parts: each rank writes and reads its own rows (`rlgraph.backends.state_files`)
    def write_parts(self, directory: str) -> dict[str, Any]:
        """Write this rank's rows of every role it holds into `directory` (no collective, no gather;
        under HSDP only the first replica writes: the others hold the same shards). Returns what
        the checkpoint's meta needs: per role written, its version, optimizer kind and part count;
        and the random streams."""
        directory = Path(directory)
        roles = {}
        for role, worker in self.models.items():
            if min(dist.get_process_group_ranks(self.role_groups[role])) not in dist.get_process_group_ranks(self.shard_groups[role]):
                continue  # a later HSDP replica
            position, ways = self._position(role)
            names = self._checkpointed(role)
            state = {name: value for name, value in role_module(worker).state_dict().items() if name in names}
            rows = {name: value.to_local() for name, value in state.items() if isinstance(value, DTensor)}
            whole = {name: value for name, value in state.items() if not isinstance(value, DTensor)}
            write_part(directory, role, position, ways, rows, whole, {name: tuple(value.shape) for name, value in state.items()})
            if worker.optimizer is not None:
                torch.save(to_device(worker.optimizer.state_dict(), torch.device("cpu")),
                           directory / optimizer_file(role, position, ways))
            roles[role] = {"version": worker.version, "optimizer": optimizer_kind(worker.optimizer), "parts": ways}
        return {"roles": roles, "shuffle_rng": self.generator.get_state(), "sampling": attrs.asdict(self.sampling)}

    def read_parts(self, directory: str, roles: Mapping[str, Mapping[str, Any]], shuffle_rng: torch.Tensor,
                   sampling: Mapping[str, Any], where: str = "the checkpoint") -> None:
        """Load this rank's rows of a checkpoint written in parts, by any number of ranks: every role
        is read and checked (names, shapes, optimizer, finite values) before anything is changed."""
        directory = Path(directory)
        layout = ExecutorState({role: RoleState({name: torch.empty(shape, device="meta") for name, shape in
                                                 tensor_names(directory, role, held["parts"]).items()},
                                                None, held["optimizer"], held["version"]) for role, held in roles.items()},
                               shuffle_rng, dict(sampling))
        kept = {role: {name: value for name, value in role_module(worker).state_dict().items()
                       if name in self._checkpointed(role)} for role, worker in self.models.items()}
        loaded = {}
        for role, worker in self.models.items():
            check_role_state(role, kept[role], optimizer_kind(worker.optimizer), layout, where)
            parts, (position, ways) = roles[role]["parts"], self._position(role)
            rows = read_rows(directory, role, parts, {name: chunk_rows(param.shape[0], position, ways)
                                                      if isinstance(param, DTensor) else None
                                                      for name, param in kept[role].items()})
            refuse_non_finite(rows, role, f"{where} ({directory})")
            optimizer = None
            if worker.optimizer is not None:  # a rank of the same layout reads its own part only
                optimizer = (read_optimizer_part(directory, role, position, parts) if parts == ways else
                             _shard_optimizer_state(read_full_optimizer(directory, role, parts), worker.optimizer.params,
                                                    position, ways))
            loaded[role] = rows, optimizer
        for role, worker in self.models.items():
            rows, optimizer = loaded[role]
            with torch.no_grad():
                for name, param in kept[role].items():
                    target = param.to_local() if isinstance(param, DTensor) else param
                    target.copy_(rows[name].to(target.device, target.dtype))
            if optimizer is not None:
                worker.optimizer.load_state_dict(optimizer)
            worker.version = roles[role]["version"]
        self.generator.set_state(shuffle_rng)
        self.sampling = SamplingStream(**sampling)

    def _position(self, role: str) -> tuple[int, int]:
        ranks = sorted(dist.get_process_group_ranks(self.shard_groups[role]))
        return ranks.index(self.rank), len(ranks)


def _shard_optimizer_state(full: Mapping[str, Any], params: list[torch.Tensor], position: int, ways: int) -> dict:
    """A full optimizer state dict cut to this rank's shards (tensors shaped like their parameter)."""
    state = {}
    for index, entries in full["state"].items():
        shape = tuple(params[int(index)].shape)
        state[index] = {key: shard_rows(value, position, ways) if isinstance(value, torch.Tensor) and tuple(value.shape) == shape
                        else value for key, value in entries.items()}
    return {"state": state, "param_groups": full["param_groups"]}


def merge_rank_states(parts: Mapping[int, Mapping[str, Any]]) -> ExecutorState:
    """The full `ExecutorState` from every rank's `export_state()` part (rank -> part): each role's
    weights from the rank that gathered them, its optimizer shards concatenated in the shard
    group's rank order; the shuffle stream is the same on every rank (rank 0's), the sampling stream
    that of the ranks that generate (`sampling_stream`)."""
    roles = {}
    for role in sorted({role for part in parts.values() for role in part["roles"]}):
        held = {rank: part["roles"][role] for rank, part in parts.items() if role in part["roles"]}
        first = held[min(held)]
        shards = [held[rank]["optimizer"] for rank in first["group"]]
        roles[role] = RoleState(next(h["model"] for h in held.values() if h["model"] is not None),
                                merge_optimizer_states(shards) if shards[0] is not None else None,
                                first["optimizer_kind"], first["version"])
    return ExecutorState(roles, parts[0]["shuffle_rng"], sampling_stream(parts))


def sampling_stream(parts: Mapping[int, Mapping[str, Any]]) -> Mapping[str, Any]:
    """The run's sampling stream among the ranks' parts: the ranks that generate advance it together
    at each sampled generate call; a rank that never generates (the trainer of a split placement)
    keeps it at its start, so the stream with the most calls is the run's (rank 0's is not, on a split)."""
    return max((part["sampling"] for part in parts.values()), key=lambda stream: stream["calls"])


def full_weights(role: str, parts: Mapping[int, Mapping[str, torch.Tensor] | None]) -> dict[str, torch.Tensor]:
    """`role`'s full weights from every rank's `full_state(role)` answer: the one its group's first
    rank gathered (the others answer None)."""
    held = [state for _, state in sorted(parts.items()) if state is not None]
    if not held:
        raise RLGraphError(f"no rank holds role {role!r}: the plan places no model of that name")
    return dict(held[0])
