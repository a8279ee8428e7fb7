"""The FSDP2 executor: one rank's roles in a torch.distributed job, as a compiled plan places them.

Built on every rank by `build_fsdp_executor(world, rank, plan, device)` (the spmd transport calls
it through `WorldSpec.build`). For each group of the plan that holds this rank:
- a role that trains or runs forward passes (policy, critic, reference) is `fully_shard`ed over the
  group's ranks: each decoder layer is an FSDP2 unit (when it holds at least
  `WorldSpec.fsdp_unit_params` parameters, 1M by default: every real LLM's layers; a tiny model's
  layers stay in the root unit, where per-layer collectives would cost more than they save) and
  the role's forward (`RoleForward`: the chunked log-prob head, or the critic's values) is the
  root, so each rank holds only its shards between steps. The optimizer steps the local shards
  (`LocalShardOptimizer`). Gradients are summed, not averaged, across ranks: the loss is already normalised
  by the global token count (the mini-batch counts are all-reduced), so the shards' gradients add
  up to the full batch's. Mixed precision on CUDA (bf16 compute, fp32 master weights, fp32
  gradient reduction); fp32 on CPU. Activation checkpointing when the plan's train layout says
  `ckpt`.
- a group that generates gets a generation engine: a full, unsharded copy of the model it serves
  (bf16 on CUDA) that the native KV-cache generator runs. `sync_weights` fills it from the FSDP2
  shards bucket by bucket (colocated: every rank all-gathers one bucket at a time; split: the
  training group's first rank broadcasts each gathered bucket to the generating ranks), and the
  engine then refuses any other version than the one it was given.

- a LoRA role (`RoleSpec.lora`) shards the peft model: the frozen base and the adapters share
  FSDP2 units (FSDP2 shards each parameter on its own, so a unit may mix frozen and trainable
  ones); only the adapters get gradients and optimizer state. Its engine is a plain model, synced
  with merged weights (W + B A * scale, gathered bucket by bucket, a layer's base and adapters in
  the same bucket), so it needs no peft. Its checkpoint part holds the adapters only. A
  `RoleSpec(base_of=...)` role (the KL reference of a LoRA policy) runs that role's FSDP2 root with
  the adapters off: no weights of its own, the same ranks (`check_views`).

Every rank of a group must run the group's steps together (FSDP2's all-gathers are collectives);
the plan runner sends a stage to all of a group's ranks, so they do.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from rlgraph.backends.local.executor import (LMWorker, LocalExecutor, RewardWorker, StaleVersionError, _optimizer_kind,
                                             check_role_state, checkpoint_weights, role_outputs)
from rlgraph.backends.local.generation import SamplingParams, SamplingStream
from rlgraph.backends.protocols import ExecutorState, ModelRef
from rlgraph.backends.vllm.engine import VLLMEngine
from rlgraph.batches import Rollouts, to_device

GENERATOR_OF = {"rollout": "policy"}
# torch 2.13 renamed all_gather_into_tensor (deprecated there); older releases have only the old name.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # a split placement's generation group serves the policy


class RoleForward(torch.nn.Module):
    """The FSDP2 root of a role: its forward is the role's per-token output, so the root's
    all-gather (embeddings, final norm, LM head) happens in a forward FSDP2 sees."""

    def __init__(self, module: torch.nn.Module, kind: str):
        super().__init__()
        self.module = module
        self.kind = kind

    def forward(self, rollouts: Rollouts, temperature: float = 1.0, with_entropy: bool = False):
        return role_outputs(self.module, self.kind, rollouts, temperature=temperature, with_entropy=with_entropy)


def role_module(worker: LMWorker) -> torch.nn.Module:
    """The model a role's FSDP2 root runs (a `base_of` view has none of its own: the view itself,
    which holds no parameters)."""
    return worker.model.module if isinstance(worker.model, RoleForward) else worker.model


def decoder_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a Hugging Face model (`...DecoderLayer`), each its own FSDP2 unit."""
    return [m for m in module.modules() if type(m).__name__.endswith("DecoderLayer")]


class FSDPExecutor(LocalExecutor):
    """A `LocalExecutor` whose trainable and reference roles are FSDP2-sharded over their group's
    ranks and whose generation runs in separate engines filled by `sync_weights`."""

    def __init__(self, models: dict[str, LMWorker], rewards: dict[str, RewardWorker], tokenizer: Any, *,
                 rank: int, device: torch.device, role_groups: dict[str, Any], shard_groups: dict[str, Any],
                 engines: dict[str, torch.nn.Module],
                 sync_groups: dict[tuple[int, ...], Any], adapters: dict[str, Any] | None = None,
                 max_new_tokens: int = 16, seed: int = 0):
        super().__init__(models, rewards, tokenizer, max_new_tokens=max_new_tokens, seed=seed)
        self.rank = rank
        self.device = device
        self.role_groups = role_groups    # role -> process group of all its data-parallel ranks
        self.shard_groups = shard_groups  # role -> this rank's FSDP2 shard group (the role group unless HSDP)
        self.engines = engines            # served role -> full model copy that generates
        self.served: dict[str, int] = {}  # served role -> the version its engine holds
        self.sync_groups = sync_groups    # {trainer leader} | generating ranks -> process group
        self.offloaded: dict[str, bool] = {}
        self.adapters = adapters or {}    # LoRA role -> its adapters to merge for the engine (`adapter_deltas`)

    # -- generation --------------------------------------------------------------------------
    def generate(self, model: ModelRef, prompts: Any, *, n: int = 1, temperature: float = 1.0, top_p: float = 1.0,
                 max_new_tokens: int | None = None, stop: Sequence[str] = ()) -> Rollouts:
        engine = self.engines.get(model.role)
        if not isinstance(engine, VLLMEngine):
            return super().generate(model, prompts, n=n, temperature=temperature, top_p=top_p,
                                    max_new_tokens=max_new_tokens, stop=stop)
        engine.wake_up()  # a plan without offload steps never put it to sleep; one with them woke it already
        params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens or self.max_new_tokens,
                                stop=stop)
        rollouts = engine.generate(prompts, n, params, seed=self.sampling.seed, call=self.sampling.advance(temperature),
                                   model=model)
        return self.cut_at_stop(rollouts, params.stop)  # the native engine's cut, so both engines end rows alike

    def _engine(self, model: ModelRef) -> torch.nn.Module:
        if model.role not in self.engines:
            raise KeyError(f"rank {self.rank} has no generation engine for {model.role!r}; the plan generates elsewhere")
        if self.served.get(model.role) != model.version:
            held = f"{model.role}@{self.served[model.role]}" if model.role in self.served else "no weights yet"
            raise StaleVersionError(f"generate asked for {model} but rank {self.rank}'s engine serves {held}: "
                                    "a sync_weights step must load that version first")
        return self.engines[model.role]

    def sync_weights(self, model: ModelRef | None, route: Any = None) -> ModelRef:
        """Fill the engines of `route.dst` with `route.role`'s FSDP2 weights, one bucket at a time."""
        role = route.role
        trains = self.rank in route.src
        if trains:
            self._live(model)
        group = None if route.colocated else self.sync_groups[_sync_ranks(route.src, route.dst)]
        buckets = list(self._buckets(role, route)) if trains else []
        layout = [self._served_layout(role, bucket) for bucket in buckets] if trains else None
        version = model.version if trains else None
        if group is not None and self.rank in _sync_ranks(route.src, route.dst):
            box = [(version, layout)]  # the generating ranks learn the version and the buckets' names and shapes
            dist.broadcast_object_list(box, src=route.src[0], group=group)
            version, layout = box[0]
        receives = self.rank in route.dst
        engine = self.engines.get(role) if receives else None
        if isinstance(engine, VLLMEngine):
            engine.wake_up(["weights"])  # before loading; the KV cache wakes at the offload before generate
        for index, names_shapes in enumerate(layout):
            fulls = self._served_bucket(role, buckets[index]) if trains else None
            if group is not None:
                fulls = self._broadcast_bucket(names_shapes, fulls, route, group)
            if receives:
                self._load_bucket(engine, [name for name, _ in names_shapes], fulls)
            del fulls  # at most one gathered bucket is alive at a time
        if receives:
            self.served[role] = version
            if isinstance(engine, VLLMEngine):
                engine.finish_sync(version)
        return ModelRef(role, version)

    @staticmethod
    def _load_bucket(engine: Any, names: list[str], fulls: list[torch.Tensor]) -> None:
        if isinstance(engine, VLLMEngine):
            engine.load_weights(zip(names, fulls))  # Hugging Face names; vLLM fuses q/k/v, gate/up itself
            return
        engine_params = dict(engine.named_parameters())
        with torch.no_grad():
            for name, full in zip(names, fulls):
                engine_params[name].copy_(full)

    def _buckets(self, role: str, route: Any) -> Iterator[list[tuple[str, Any]]]:
        """The trained model's parameters in order, grouped into buckets of <= `route.bucket_bytes` (fp32);
        a LoRA layer's base weight and adapters are never split (they merge into one tensor)."""
        bucket, size = [], 0
        for layer in _merge_units(role_module(self.models[role]).named_parameters()):
            nbytes = sum(param.numel() for _, param in layer) * 4
            if bucket and size + nbytes > route.bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.extend(layer)
            size += nbytes
        if bucket:
            yield bucket

    def _served_layout(self, role: str, bucket: list[tuple[str, Any]]) -> list[tuple[str, tuple[int, ...]]]:
        """The names and shapes the engine receives for `bucket` (LoRA: the plain model's, no adapters)."""
        if role not in self.adapters:
            return [(name, tuple(param.shape)) for name, param in bucket]
        from rlgraph.backends.lora import plain_name

        return [(plain_name(name), tuple(param.shape)) for name, param in bucket if plain_name(name) is not None]

    def _served_bucket(self, role: str, bucket: list[tuple[str, Any]]) -> list[torch.Tensor]:
        """`bucket`'s full tensors (one all-gather) as the engine takes them: a LoRA role's merged."""
        fulls = gather_full([param for _, param in bucket])
        if role not in self.adapters:
            return fulls
        from rlgraph.backends.lora import merge_adapters

        with torch.no_grad():
            return list(merge_adapters(dict(zip([name for name, _ in bucket], fulls)), self.adapters[role]).values())

    def _broadcast_bucket(self, names_shapes, fulls, route, group) -> list[torch.Tensor] | None:
        """The trainer's first rank sends one flat fp32 bucket to the generating ranks."""
        if self.rank not in _sync_ranks(route.src, route.dst):
            return fulls
        shapes = [shape for _, shape in names_shapes]
        sizes = [torch.Size(shape).numel() for shape in shapes]
        if self.rank == route.src[0]:
            flat = torch.cat([full.float().reshape(-1) for full in fulls]).to(self._comm_device())
        else:
            flat = torch.empty(sum(sizes), dtype=torch.float32, device=self._comm_device())
        dist.broadcast(flat, src=route.src[0], group=group)
        return [piece.view(shape) for piece, shape in zip(flat.split(sizes), shapes)]

    # -- training hooks ----------------------------------------------------------------------
    def _forward(self, worker: LMWorker, rollouts: Rollouts, *, temperature: float, with_entropy: bool):
        return worker.model(rollouts, temperature=temperature, with_entropy=with_entropy)

    def _all_reduce_sum(self, role: str, values: torch.Tensor) -> torch.Tensor:
        reduced = values.to(self._comm_device())
        dist.all_reduce(reduced, group=self.role_groups[role])
        return reduced.to(values.device)

    def _clip_grads(self, worker: LMWorker, clip: float) -> float:
        """The global gradient norm from the local shards (one all-reduce), then a local rescale:
        what `clip_grad_norm_` computes over DTensors, without a DTensor dispatch per parameter."""
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                 for p in worker.model.parameters() if p.grad is not None]
        if not grads:
            return 0.0
        squares = torch.stack([g.detach().float().square().sum() for g in grads]).sum().reshape(1).to(self._comm_device())
        dist.all_reduce(squares, group=self.shard_groups[self._role_of(worker)])  # replicas hold the same shards
        norm = float(squares.sqrt())
        if math.isfinite(clip) and norm > clip:
            torch._foreach_mul_(grads, clip / (norm + 1e-6))  # the factor clip_grad_norm_ applies
        return norm

    def _comm_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    # -- memory ------------------------------------------------------------------------------
    def offload(self, role: str, direction: str) -> None:
        """Optimizer state and gradients to host memory (`offload`) or back (`onload`).

        On a CPU device they are host memory already: the step is recorded, nothing moves.
        """
        self.offloaded[role] = direction == "offload"
        engine = self.engines.get(role)
        if isinstance(engine, VLLMEngine):  # the engine and the trainer's state take turns on the device
            engine.sleep() if direction == "onload" else engine.wake_up(["kv_cache"])
        worker = self.models.get(role)
        if worker is None or worker.optimizer is None or self.device.type != "cuda" or _on_host(worker):
            return
        target = torch.device("cpu") if direction == "offload" else self.device
        for state in worker.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    state[key] = value.to(target, non_blocking=True)
        if direction == "offload":
            for param in worker.model.parameters():
                param.grad = None
        torch.cuda.synchronize(self.device)

    def full_state(self, role: str, names: set[str] | None = None) -> dict[str, torch.Tensor] | None:
        """`role`'s unsharded state dict (or its tensors `names`) on the CPU; every rank of its group
        calls it, its first rank returns it."""
        if role not in self.models:
            return None
        state = {name: (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu()
                 for name, value in role_module(self.models[role]).state_dict().items() if names is None or name in names}
        first = min(dist.get_process_group_ranks(self.role_groups[role]))
        return state if self.rank == first else None

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
                           "optimizer_kind": _optimizer_kind(worker.optimizer)}
        return {"roles": roles, "shuffle_rng": self.generator.get_state(), "sampling": attrs.asdict(self.sampling)}

    def import_state(self, state: ExecutorState, where: str = "the checkpoint") -> None:
        """Load this rank's shards of a full checkpoint state (all or nothing, checked first)."""
        kept = {role: {name: value for name, value in role_module(worker).state_dict().items()
                       if name in self._checkpointed(role)} for role, worker in self.models.items()}
        for role, worker in self.models.items():
            check_role_state(role, kept[role], _optimizer_kind(worker.optimizer), state, where)
        for role, worker in self.models.items():
            held, position, ways = state.roles[role], *self._position(role)
            with torch.no_grad():
                for name, param in kept[role].items():
                    target = param.to_local() if isinstance(param, DTensor) else param
                    source = _rows(held.model[name], position, ways) if isinstance(param, DTensor) else held.model[name]
                    target.copy_(source.to(target.device, target.dtype))
            if worker.optimizer is not None:
                worker.optimizer.load_state_dict(_shard_optimizer_state(held.optimizer, worker.optimizer.params, position, ways))
            worker.version = held.version
        self.generator.set_state(state.shuffle_rng)
        self.sampling = SamplingStream(**state.sampling)

    def _position(self, role: str) -> tuple[int, int]:
        ranks = sorted(dist.get_process_group_ranks(self.shard_groups[role]))
        return ranks.index(self.rank), len(ranks)

    def weights_report(self, role: str) -> dict[str, Any]:
        """What this rank holds of `role`: parameter elements held locally and in the whole model,
        the version its engine serves, and the largest |engine - gathered FSDP2 weight| (every rank
        of the role's group must call it: the comparison all-gathers)."""
        report: dict[str, Any] = {"served": self.served.get(role)}
        if role in self.models:
            params = list(role_module(self.models[role]).named_parameters())
            report["local_numel"] = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for _, p in params)
            report["global_numel"] = sum(p.numel() for _, p in params)
            if role in self.engines and not isinstance(self.engines[role], VLLMEngine):
                engine = dict(self.engines[role].named_parameters())
                served = zip([name for name, _ in self._served_layout(role, params)], self._served_bucket(role, params))
                report["engine_diff"] = max(float((engine[name].float() - full.float()).abs().max()) for name, full in served)
        return report


def gather_full(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The full tensors of FSDP2-sharded parameters (dim-0 shards on a 1-D mesh) with one
    all-gather for the whole list, instead of one `full_tensor()` collective per parameter."""
    sharded = [p for p in params if isinstance(p, DTensor)]
    if not sharded:
        return [p.detach() for p in params]
    mesh = sharded[0].device_mesh
    mesh = mesh["shard"] if mesh.ndim > 1 else mesh  # HSDP: every replica holds all the shards
    ranks = mesh.size()
    locals_, rows = [], []
    for p in sharded:
        per_rank = -(-p.shape[0] // ranks)  # torch.chunk's shard rows; the last shards may be shorter or empty
        local = p.to_local().detach().reshape(-1)
        width = per_rank * math.prod(p.shape[1:])
        locals_.append(torch.nn.functional.pad(local, (0, width - local.numel())))
        rows.append(per_rank)
    flat = torch.cat(locals_).to(mesh.device_type)  # [sum of padded shard sizes]; cpu_offload shards come from the host
    gathered = torch.empty(ranks * flat.numel(), dtype=flat.dtype, device=flat.device)
    _all_gather(gathered, flat, group=mesh.get_group())  # one collective per bucket
    gathered = gathered.view(ranks, -1)  # [ranks, sum of padded shard sizes]
    fulls, offset = {}, 0
    for p, piece, per_rank in zip(sharded, locals_, rows):
        block = gathered[:, offset:offset + piece.numel()].reshape(ranks * per_rank, *p.shape[1:])
        fulls[id(p)] = block[:p.shape[0]]  # drop the padding of the last shards
        offset += piece.numel()
    return [fulls[id(p)] if id(p) in fulls else p.detach() for p in params]


def _rows(full: torch.Tensor, position: int, ways: int) -> torch.Tensor:
    """The dim-0 shard rank `position` of `ways` holds under FSDP2 (`torch.chunk`; possibly empty)."""
    chunks = torch.chunk(full, ways, dim=0)
    return chunks[position] if position < len(chunks) else full[:0]


def _shard_optimizer_state(full: Mapping[str, Any], params: list[torch.Tensor], position: int, ways: int) -> dict:
    """A full optimizer state dict cut to this rank's shards (tensors shaped like their parameter)."""
    state = {}
    for index, entries in full["state"].items():
        shape = tuple(params[int(index)].shape)
        state[index] = {key: _rows(value, position, ways) if isinstance(value, torch.Tensor) and tuple(value.shape) == shape
                        else value for key, value in entries.items()}
    return {"state": state, "param_groups": full["param_groups"]}


def merge_optimizer_states(parts: list[Mapping[str, Any]]) -> dict[str, Any]:
    """The full optimizer state dict from the ranks' shard states, in rank order (dim-0 shards
    concatenate; scalars such as `step` are the same on every rank)."""
    state = {}
    for index, entries in parts[0]["state"].items():
        state[index] = {key: torch.cat([part["state"][index][key] for part in parts])
                        if isinstance(value, torch.Tensor) and value.dim() > 0 else value
                        for key, value in entries.items()}
    return {"state": state, "param_groups": parts[0]["param_groups"]}


def _merge_units(named: Iterator[tuple[str, Any]]) -> Iterator[list[tuple[str, Any]]]:
    """Consecutive parameters that merge into one served tensor: a LoRA layer's `base_layer`
    tensors and its adapters (peft registers them together); any other parameter on its own."""
    unit, key = [], None
    for name, param in named:
        layer = name.split(".base_layer.")[0] if ".base_layer." in name else name.split(".lora_")[0]
        if unit and layer != key:
            yield unit
            unit = []
        unit.append((name, param))
        key = layer
    if unit:
        yield unit


def _sync_ranks(src: tuple[int, ...], dst: tuple[int, ...]) -> tuple[int, ...]:
    """The ranks of a split sync's broadcast: the trainer's first rank and the generating ranks."""
    return tuple(sorted({src[0], *dst}))


# -- building one rank's executor from the plan ---------------------------------------------------------


def _rank_sets(plan: Any) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """Every group's ranks (and HSDP's rows and columns), and the broadcast ranks of every split
    weight sync, from the plan's groups alone, in the same order on every process: a generating
    group syncs from the group that trains the role it serves, when those ranks differ."""
    groups = {group.name: group for group in plan.groups}
    role_sets = {tuple(group.ranks) for group in plan.groups}
    for group in plan.groups:  # HSDP: each shard group (a row) and each replicate group (a column)
        if group.train is not None and group.train.dp > 1:
            rows, columns = _hsdp_groups(group.ranks, group.train.fsdp)
            role_sets.update(rows + columns)
    role_sets = sorted(role_sets)
    sync_sets = []
    for group in plan.groups:
        trainer = groups.get(GENERATOR_OF.get(group.name, group.name))
        if group.generate is None or trainer is None or trainer.train is None:
            continue
        if set(trainer.ranks) != set(group.ranks) and _sync_ranks(trainer.ranks, group.ranks) not in sync_sets:
            sync_sets.append(_sync_ranks(trainer.ranks, group.ranks))
    return role_sets, sync_sets


def _hsdp_groups(ranks: tuple[int, ...], fsdp: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """The shard groups (consecutive blocks of `fsdp` ranks, one per replica) and the replicate
    groups (the ranks holding the same shard in each replica) of an HSDP layout."""
    rows = [tuple(ranks[start:start + fsdp]) for start in range(0, len(ranks), fsdp)]
    return rows, [tuple(row[column] for row in rows) for column in range(fsdp)]


def _role_mesh(group: Any, rank: int, process_groups: dict, device: torch.device) -> tuple[DeviceMesh, Any]:
    """The role's DeviceMesh (1-D over the group, or 2-D (replicate, shard) for HSDP) and this rank's shard group."""
    layout = group.train
    if layout is None or layout.dp == 1:
        whole = process_groups[tuple(group.ranks)]
        return DeviceMesh.from_group(whole, device.type), whole
    rows, columns = _hsdp_groups(group.ranks, layout.fsdp)
    row = next(row for row in rows if rank in row)
    column = next(column for column in columns if rank in column)
    mesh = DeviceMesh.from_group([process_groups[column], process_groups[row]], device.type,
                                 mesh=torch.tensor(group.ranks).view(layout.dp, layout.fsdp),
                                 mesh_dim_names=("replicate", "shard"))
    return mesh, process_groups[row]


def build_fsdp_executor(world: Any, rank: int, plan: Any, device: torch.device) -> FSDPExecutor:
    """Rank `rank`'s roles: FSDP2-sharded models for the groups that train or infer on it, engines for
    the groups that generate on it. Every process creates every process group (torch requires it)."""
    check_views(world.views(), plan)
    role_sets, sync_sets = _rank_sets(plan)
    process_groups = {ranks: dist.new_group(list(ranks)) for ranks in role_sets}
    sync_groups = {ranks: dist.new_group(list(ranks)) for ranks in sync_sets}
    tokenizer = world.load_tokenizer()
    models, engines, role_groups, shard_groups, adapters, views = {}, {}, {}, {}, {}, []
    for group in plan.groups:
        if rank not in group.ranks:
            continue
        if group.name not in GENERATOR_OF:
            spec = _role_spec(world, group.name)
            role_groups[group.name] = process_groups[tuple(group.ranks)]
            if spec.base_of is not None:
                views.append(group.name)  # built once the role it views is
                continue
            mesh, shard_groups[group.name] = _role_mesh(group, rank, process_groups, device)
            models[group.name] = _sharded_role(spec, group, mesh, tokenizer, device, world.fsdp_unit_params)
            if spec.lora is not None:
                from rlgraph.backends.lora import adapter_deltas

                adapters[group.name] = adapter_deltas(role_module(models[group.name]))
        if group.generate is not None:
            served = GENERATOR_OF.get(group.name, group.name)
            engines[served] = _generation_engine(world, served, group, rank, tokenizer, device)
    for role in views:
        from rlgraph.backends.lora import base_view

        root = models[world.viewed(role)].model
        models[role] = LMWorker(base_view(root.module, root))
        shard_groups[role] = role_groups[role]
    return FSDPExecutor(models, {name: RewardWorker(fn) for name, fn in world.rewards.items()}, tokenizer, rank=rank,
                        device=device, role_groups=role_groups, shard_groups=shard_groups, engines=engines,
                        sync_groups=sync_groups, adapters=adapters,
                        max_new_tokens=world.max_new_tokens, seed=world.seed)


def check_views(views: Mapping[str, str], plan: Any) -> None:
    """A view role (a LoRA policy's reference: `views[role]`'s module with its adapters off) runs the
    viewed role's FSDP2 root, whose all-gathers span that role's ranks: the plan must place both on
    the same ranks (a colocated placement does). Raises ValueError naming both placements otherwise.
    `views` is `WorldSpec.views()`, or {"ref": "policy"} for a config with LoRA before any role exists."""
    groups = {group.name: group for group in plan.groups}
    for role, base in views.items():
        if role not in groups:
            continue
        held = sorted(groups[base].ranks) if base in groups else []
        if sorted(groups[role].ranks) != held:
            raise ValueError(f"role {role!r} is role {base!r} with its LoRA adapters off (no weights of its own), so it "
                             f"must run on the ranks of {base!r}, {held}, but the plan places it on ranks "
                             f"{sorted(groups[role].ranks)}: use a colocated placement, or give it {base!r}'s group")


def _generation_engine(world: Any, served: str, group: Any, rank: int, tokenizer: Any, device: torch.device) -> Any:
    """The engine a generating rank runs: a full copy of the model for the native generator, or
    a vLLM engine (GPU only; UNTESTED against a live vLLM, see rlgraph/backends/vllm/engine.py)."""
    spec = _role_spec(world, served)
    if group.generate.engine == "vllm":
        if device.type != "cuda":
            raise ValueError(f"group {group.name!r} generates with vLLM, which needs CUDA; compile with engine='native'")
        source = spec.source if isinstance(spec.source, (str, os.PathLike)) and os.path.isdir(spec.source) else None
        if source is None:
            raise ValueError(f"group {group.name!r} generates with vLLM, which loads a Hugging Face model directory: "
                             f"set RoleSpec(source=<directory>) for {served!r} (it is {spec.source!r})")
        return VLLMEngine.build(source, role=served, eos_token_id=tokenizer.eos_token_id,
                                pad_token_id=tokenizer.pad_token_id, rank=rank, seed=world.seed, load_format="dummy",
                                tensor_parallel_size=group.generate.tp)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return spec.build_module(tokenizer, dtype, merged=True).to(device).eval().requires_grad_(False)  # LoRA: plain, merged


def _role_spec(world: Any, role: str) -> Any:
    if role not in world.roles:
        raise KeyError(f"the plan places role {role!r} but the run defines only {', '.join(world.roles)}; "
                       f"add RoleSpec for {role!r} to the WorldSpec")
    return world.roles[role]


def _sharded_role(spec: Any, group: Any, mesh: DeviceMesh, tokenizer: Any, device: torch.device,
                  unit_params: int) -> LMWorker:
    layout = group.train
    module = spec.build_module(tokenizer).to(device)
    if layout is not None and layout.checkpointing:
        lm = getattr(module, "backbone", module)
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    precision = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                 if device.type == "cuda" else MixedPrecisionPolicy())
    # cpu_offload: shards, gradients and optimizer state in host memory; pinned only with CUDA (pinning
    # needs an accelerator), and on a CPU device FSDP2's copies to "the device" move nothing.
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if layout is not None and layout.cpu_offload else OffloadPolicy()
    root = RoleForward(module, spec.kind)
    for layer in decoder_layers(module):
        if sum(p.numel() for p in layer.parameters()) >= unit_params:
            fully_shard(layer, mesh=mesh, mp_policy=precision, offload_policy=offload)
    fully_shard(root, mesh=mesh, mp_policy=precision, offload_policy=offload)
    for unit in root.modules():
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(1.0)  # sum the shards' gradients: the loss is globally normalised
            unit.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)
    optimizer = LocalShardOptimizer(root.parameters(), spec.build_optimizer) if spec.optimizer else None
    return LMWorker(root, optimizer, kind=spec.kind)


def _on_host(worker: LMWorker) -> bool:
    """Whether FSDP2 keeps `worker`'s shards, and so its optimizer state, in host memory (cpu_offload):
    then an offload step has nothing to move, and an onload must not pull the state away from them."""
    return any(_local(param).device.type == "cpu" for param in worker.model.parameters())


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (sharing its storage), or the tensor itself."""
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach()


class LocalShardOptimizer:
    """An elementwise optimizer (SGD, AdamW) stepping each rank's shards of FSDP2 parameters in place.

    Elementwise updates give the same numbers on a shard as on the whole tensor, and stepping plain
    tensors avoids a DTensor dispatch per operation per parameter (on the CPU demo that was ~15 ms
    of a 100 ms step). The optimizer state is sharded by construction. Not for optimizers that take
    whole-tensor statistics (LAMB, Shampoo, Muon): those need the DTensor parameters.
    """

    def __init__(self, params: Any, build: Any):
        self.params = [p for p in params if p.requires_grad]
        self.shards = [torch.nn.Parameter(_local(p)) for p in self.params]  # aliases of the shards' storage
        self.optimizer = build(self.shards)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in (*self.params, *self.shards):
            param.grad = None

    def step(self) -> None:
        for shard, param in zip(self.shards, self.params):
            shard.grad = None if param.grad is None else _local(param.grad)
        self.optimizer.step()

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)
