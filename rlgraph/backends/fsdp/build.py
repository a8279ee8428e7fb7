"""Building one rank's FSDP2 executor from the plan (`WorldSpec.build` calls `build_fsdp_executor`).

For each group of the plan that holds the rank: a role that trains or runs forward passes is
sharded with FSDP2 over the group's ranks (`_sharded_role`: a 1-D mesh, or a 2-D (replicate,
shard) mesh for HSDP); a group that generates gets a generation engine (`_generation_engine`;
vLLM on every rank or on none, `check_vllm_ranks`). A LoRA role shards the peft model: the
frozen base and the adapters share FSDP2 units (FSDP2 shards each parameter on its own, so a
unit may mix frozen and trainable ones); only the adapters get
gradients and optimizer state; colocated with its native engine on the CPU, the frozen base is not
sharded but held once, whole, and the engine runs on it (`shares_base`). A `RoleSpec(base_of=...)`
role (the KL reference of a LoRA policy)
runs that role's FSDP2 root with the adapters off: no weights of its own, the same ranks
(`check_views`). Every process creates every process group (torch requires it), in the same order.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from rlgraph.backends.fsdp.loading import (LoraStartSource, WeightSource, fill_shards, holds_adapters, missing_names,
                                          parameters_on_meta)
from rlgraph.backends.fsdp.shards import LocalShardOptimizer, RoleForward, decoder_layers, engine_dtype, role_module
from rlgraph.backends.fsdp.sync import sync_ranks
from rlgraph.backends.fsdp.executor import FSDPExecutor
from rlgraph.backends.local.state import LMWorker
from rlgraph.backends.local.executor import RewardWorker
from rlgraph.backends.local.models import build_causal_lm, config_only
from rlgraph.backends.vllm.engine import VLLMEngine

GENERATOR_OF = {"rollout": "policy"}  # a split placement's generation group serves the policy


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
        if set(trainer.ranks) != set(group.ranks) and sync_ranks(trainer.ranks, group.ranks) not in sync_sets:
            sync_sets.append(sync_ranks(trainer.ranks, group.ranks))
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
    check_vllm_ranks(plan)
    role_sets, sync_sets = _rank_sets(plan)
    process_groups = {ranks: dist.new_group(list(ranks)) for ranks in role_sets}
    sync_groups = {ranks: dist.new_group(list(ranks)) for ranks in sync_sets}
    tokenizer = world.load_tokenizer()
    models, engines, role_groups, shard_groups, adapters, views = {}, {}, {}, {}, {}, []
    shared: set[str] = set()  # LoRA roles whose engine runs on the role's own base (`shares_base`)
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
            keep_base = shares_base(spec, group, device)
            models[group.name] = _sharded_role(spec, group, mesh, tokenizer, device, world.fsdp_unit_params, keep_base)
            if spec.lora is not None:
                from rlgraph.backends.lora import adapter_deltas

                adapters[group.name] = adapter_deltas(role_module(models[group.name]))
            if keep_base:
                shared.add(group.name)
        if group.generate is not None:
            served = GENERATOR_OF.get(group.name, group.name)
            if served in shared:
                engines[served] = _engine_on_base(world, served, role_module(models[served]), adapters[served], tokenizer, device)
            else:
                engines[served] = _generation_engine(world, served, group, rank, tokenizer, device, plan.groups)
    for role in views:
        from rlgraph.backends.lora import base_view

        root = models[world.viewed(role)].model
        models[role] = LMWorker(base_view(root.module, root))
        shard_groups[role] = role_groups[role]
    executor = FSDPExecutor(models, {name: RewardWorker(fn) for name, fn in world.rewards.items()}, tokenizer, rank=rank,
                            device=device, role_groups=role_groups, shard_groups=shard_groups, engines=engines,
                            sync_groups=sync_groups, adapters=adapters, shared_base=shared,
                            max_new_tokens=world.max_new_tokens, seed=world.seed, envs=world.envs,
                            decode_compile=world.decode_compile)
    # A frozen generator's engine (a teacher's in `gkd` with lam < 1) is built with its weights and no
    # sync_weights step ever loads it: it serves the role's one version from the start.
    trained = {group.name for group in plan.groups if group.train is not None}
    executor.served.update({role: 0 for role in engines if role not in trained and role not in shared})
    return executor


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


def shares_base(spec: Any, group: Any, device: torch.device) -> bool:
    """Whether a LoRA role's generation engine runs on the role's own frozen base
    (`rlgraph.lora_layout.shares_lora_base`, the rule the memory model counts by: trained and generated on the same ranks by the native
    engine, in fp32, the LM head not adapted). Then the base stays whole on each rank (FSDP2 ignores
    it; only the adapters are sharded) and the engine owns only the adapted linears, filled merged
    (W + B A * scale) at each sync: the base is held once per rank, not as a shard plus the engine's
    full copy, and a sync moves the adapters alone."""
    if spec.lora is None:
        return False
    from rlgraph.backends.lora import LoraSettings
    from rlgraph.lora_layout import shares_lora_base

    engine = group.generate.engine if group.generate is not None else "none"
    return shares_lora_base(LoraSettings(**spec.lora).target_modules, trains=group.train is not None, engine=engine,
                            param_dtype=engine_dtype(device))


def _engine_on_base(world: Any, served: str, role_model: torch.nn.Module, adapters: Mapping[str, Any], tokenizer: Any,
                    device: torch.device) -> torch.nn.Module:
    """The plain model a `shares_base` role generates with: every parameter no adapter changes is
    the role's own base tensor (the same storage); each adapted linear's weight is the engine's own,
    allocated empty for the first sync to fill with the merged weight."""
    from rlgraph.backends.lora import plain_name

    spec = _role_spec(world, served)
    base = {plain_name(name): param for name, param in role_model.named_parameters(remove_duplicate=False)
            if plain_name(name) is not None}
    with parameters_on_meta():
        engine = build_causal_lm(config_only(spec.source), tokenizer=tokenizer, seed=spec.seed, dtype=engine_dtype(device))
    for prefix, module in engine.named_modules():
        for key, param in list(module._parameters.items()):
            name = f"{prefix}.{key}" if prefix else key
            if param is None:
                continue
            if name in adapters:
                module._parameters[key] = torch.nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device),
                                                             requires_grad=False)
            else:
                held = base[name]
                assert held.device.type != "meta" and tuple(held.shape) == tuple(param.shape), (name, held.shape)
                module._parameters[key] = held  # the role's whole base tensor (FSDP2 ignores it)
    return engine.eval()


def _generation_engine(world: Any, served: str, group: Any, rank: int, tokenizer: Any, device: torch.device,
                       plan_groups: Any = ()) -> Any:
    """The engine a generating rank runs: a full copy of the model for the native generator, or
    a vLLM engine (`_vllm_engine`).
    The native engine of a role the plan trains is allocated empty: the plan's sync_weights step
    before its every generate loads it (no second full read of the model at start-up); a frozen
    generator's is built with its weights."""
    spec = _role_spec(world, served)
    if group.generate.engine == "vllm":
        return _vllm_engine(world, spec, served, group, rank, tokenizer, device)
    trained = next((other.train for other in plan_groups if other.name == served), None) is not None
    if trained:  # every generate of a trained role follows a sync_weights step: the first one fills the engine
        from rlgraph.backends.fsdp.loading import allocate
        from rlgraph.backends.local.vlm import build_language_model

        with parameters_on_meta():  # the plain model (a LoRA role's engine serves its merged weights)
            engine = build_language_model(config_only(spec.source), tokenizer=tokenizer, seed=spec.seed, dtype=engine_dtype(device))
        allocate(engine, device)
        return engine.eval().requires_grad_(False)
    return spec.build_module(tokenizer, engine_dtype(device), merged=True).to(device).eval().requires_grad_(False)  # LoRA: plain, merged


def _vllm_engine(world: Any, spec: Any, served: str, group: Any, rank: int, tokenizer: Any,
                 device: torch.device) -> VLLMEngine:
    """This rank's vLLM engine for `served` (`external_launcher`: in this process, one per generating
    rank, tp=`group.generate.tp`), built from the role's config with dummy weights: the plan's
    sync_weights step before its first generate loads the gathered FSDP2 weights. It joins this
    process's torch.distributed world, so every rank builds one at this point (`check_vllm_ranks`)."""
    from rlgraph.backends.local.vlm import build_language_model
    from rlgraph.backends.vllm.engine import engine_from_config

    with parameters_on_meta():  # the config is all the engine needs (a VLM's too: it is refused with the reason)
        module = build_language_model(config_only(spec.source), tokenizer=tokenizer, seed=spec.seed)
    return engine_from_config(module.config.to_dict(), role=served, tokenizer=tokenizer, rank=rank, seed=world.seed,
                              where=f"role {served!r} (model {spec.source!r})", tensor_parallel_size=group.generate.tp,
                              enforce_eager=device.type == "cpu")  # CPU: no compiled graphs to warm up


def check_vllm_ranks(plan: Any) -> None:
    """Refuse (ValueError) a multi-rank plan where some rank builds no vLLM engine, or two.

    vLLM's `external_launcher` engine joins its process's whole torch.distributed world: while it
    starts, every rank of the job creates vLLM's process groups (`new_group` is collective over the
    world) and takes part in its memory all-reduce. A rank that builds no engine never joins, and
    the others wait for it until the start-up timeout; a second engine in one process finds vLLM's
    groups made already. So on the spmd and Ray runtimes every rank generates with exactly one vLLM
    engine: a colocated placement (the hybrid engine of verl and TRL), not a split one."""
    engines = [group for group in plan.groups if group.generate is not None and group.generate.engine == "vllm"]
    if not engines:
        return
    ranks = sorted({rank for group in plan.groups for rank in group.ranks})
    held = [rank for group in engines for rank in group.ranks]
    idle = [rank for rank in ranks if rank not in held]
    twice = sorted({rank for rank in held if held.count(rank) > 1})
    if idle or twice:
        what = (f"ranks {idle} build no vLLM engine" if idle else f"ranks {twice} would build two vLLM engines")
        raise ValueError(f"the plan generates with vLLM on ranks {sorted(set(held))} of {ranks}, but {what}: vLLM's "
                         "external_launcher engine joins the whole torch.distributed world while it starts (every rank "
                         "creates its process groups and joins its memory all-reduce), so the job would wait for "
                         "those ranks until it timed out; every rank must run exactly one vLLM engine\n  fix: a "
                         "colocated placement (colocated:offload=False on CPU), or engine native")


def _empty_module(spec: Any, tokenizer: Any) -> tuple[torch.nn.Module | None, Any]:
    """The role's module with its parameters on the meta device, and the source that fills every
    one of them (its weights file, or the safetensors of its model directory; a LoRA role given a
    plain base: that base under peft's names plus its adapters, drawn here as every runtime draws
    them, `LoraStartSource`); (None, None) when the role has no start-up weights, or they leave
    some parameters out."""
    source = spec.weight_source()
    if source is None and isinstance(spec.source, (str, os.PathLike)):
        source = WeightSource.of_model_dir(spec.source)  # the model's own files, each rank reading its rows
    if source is None:
        return None, None
    if spec.lora is not None and not holds_adapters(source):
        module, adapters = spec.build_lora_on_meta(tokenizer)
        source = LoraStartSource.of(source, module, adapters)
    else:
        with parameters_on_meta():
            module = spec.build_module(tokenizer, empty=True)
    if missing_names(module, source):
        return None, None
    return module, source


def _role_spec(world: Any, role: str) -> Any:
    if role not in world.roles:
        raise KeyError(f"the plan places role {role!r} but the run defines only {', '.join(world.roles)}; "
                       f"add RoleSpec for {role!r} to the WorldSpec")
    return world.roles[role]


def _sharded_role(spec: Any, group: Any, mesh: DeviceMesh, tokenizer: Any, device: torch.device,
                  unit_params: int, keep_base: bool = False) -> LMWorker:
    """The role's model `fully_shard`ed on `mesh` (its large decoder layers as units, `RoleForward`
    as the root), with a `LocalShardOptimizer` when it trains. `keep_base` (`shares_base`): FSDP2
    ignores the frozen parameters, which stay whole on the rank; only the adapters are sharded."""
    layout = group.train
    module, source = _empty_module(spec, tokenizer)
    if source is None:  # no weights to read (built from `source`), or not all of them: the whole model here
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
    ignored = {param for param in module.parameters() if not param.requires_grad} if keep_base else None
    for layer in decoder_layers(module):
        if sum(p.numel() for p in layer.parameters()) >= unit_params:
            fully_shard(layer, mesh=mesh, mp_policy=precision, offload_policy=offload, ignored_params=ignored)
    fully_shard(root, mesh=mesh, mp_policy=precision, offload_policy=offload, ignored_params=ignored)
    if source is not None:
        fill_shards(root, module, source, device)  # allocate the shards and read only their rows
    for unit in root.modules():
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(1.0)  # sum the shards' gradients: the loss is globally normalised
            unit.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)
    optimizer = LocalShardOptimizer(root.parameters(), spec.build_optimizer) if spec.optimizer else None
    return LMWorker(root, optimizer, kind=spec.kind)

