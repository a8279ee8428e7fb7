"""Per-rank memory of every group and phase of a placed program (used by `place`).

Bridges the program (which roles train, infer and generate, with which micro-batches) and the
memory model of `rlgraph.plan.memory`. Colocated groups share ranks: every moment of their phases
(`colocated_moments`) is checked against the device capacity. What a group keeps
in host memory (its state under `cpu_offload`, or what a colocated offload step parks) is counted
per rank and checked against each node's host memory. A role in `options.lora` trains adapters
over a frozen base, and the reference of a LoRA policy on the policy's ranks is that same module
with its adapters off: no weights of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from rlgraph.ir import specs as S
from rlgraph.errors import ConfigError, did_you_mean
from rlgraph.ir.primitives import GENERATORS, primitive_name
from rlgraph.ir.program import Program
from rlgraph.passes.options import CompileOptions
from rlgraph.plan import memory as M
from rlgraph.plan.mesh import Colocated, Group, Mesh
from rlgraph.plan.model_size import ModelShape
from rlgraph.plan.presets import role_model_shape
from rlgraph.plan.vision_size import DEFAULT_PIXEL_BUDGET

def model_shape(options: CompileOptions, role: str) -> ModelShape:
    return role_model_shape(options.models, role)


def pixel_budget(options: CompileOptions) -> int:
    return options.pixel_budget if options.pixel_budget is not None else DEFAULT_PIXEL_BUDGET


def image_tokens(options: CompileOptions, role: str) -> int:
    """Image tokens a prompt of `role`'s model carries at the pixel budget (0 for a text-only model):
    they lengthen every sequence of that role beyond P + T."""
    vision = model_shape(options, role).vision
    if vision is None:
        return 0
    per_image = vision.image_tokens(pixel_budget(options))
    if per_image < 1:
        side = vision.patch * vision.merge
        raise ConfigError(f"pixel_budget={pixel_budget(options)} is smaller than one {side}x{side}-pixel block, "
                          f"the least an image becomes in the vision tower of role {role!r} (one image token)",
                          fix=f"pixel_budget >= {side * side}")
    return options.images_per_prompt * per_image


def pixel_bytes_per_row(options: CompileOptions) -> int:
    """Bytes the images of one `Prompts` / `Rollouts` row add to a move of it (each row carries its
    prompt's pixels and grids, at the pixel budget): 0 for a text policy."""
    vision = model_shape(options, "policy").vision
    return 0 if vision is None else options.images_per_prompt * vision.pixel_bytes_per_image(pixel_budget(options))


def vision_memory(options: CompileOptions, role: str, images: int, *, training: bool) -> M.MemoryBreakdown:
    """The activations `images` images hold in one forward of `role`'s vision tower (none for a text
    model, or a prompt with no image); a frozen tower keeps no activations for backward."""
    shape = model_shape(options, role)
    if shape.vision is None:
        return M.MemoryBreakdown()
    per_image = shape.vision.activation_bytes_per_image(pixel_budget(options), param_dtype(options.mesh),
                                                        training=training and shape.train_vision)
    return M.MemoryBreakdown(activations=images * options.images_per_prompt * per_image)


def vision_facts(program: Program, options: CompileOptions) -> dict[str, dict[str, int]]:
    """What the plan prints of each vision-language role: its tower and its images' tokens, FLOPs and bytes."""
    roles = sorted({node.args[0].meta["spec"].role for node in program.graph.nodes
                    if primitive_name(node) not in (None, "score", "filter_groups") and node.args
                    and hasattr(node.args[0].meta.get("spec"), "role")})
    facts = {}
    for role in roles:
        shape = model_shape(options, role)
        if shape.vision is None:
            continue
        budget, dtype = pixel_budget(options), param_dtype(options.mesh)
        facts[role] = {
            "tower_params": shape.vision.n_params, "tower_trained": int(shape.train_vision),
            "pixel_budget": budget, "images_per_prompt": options.images_per_prompt,
            "tokens_per_image": shape.vision.image_tokens(budget),
            "flops_per_image": int(shape.vision.flops_per_image(budget, training=shape.train_vision)),
            "activation_bytes_per_image": shape.vision.activation_bytes_per_image(
                budget, dtype, training=shape.train_vision),
        }
    return facts


def param_dtype(mesh: Mesh) -> torch.dtype:
    return torch.float32 if mesh.device == "cpu" else torch.bfloat16


def param_bytes(shape: ModelShape, mesh: Mesh) -> int:
    return shape.n_params * torch.empty((), dtype=param_dtype(mesh)).element_size()


def batch_rows(node, sizes: dict[str, int]) -> int:
    """Rows a primitive works on at concrete sizes: its rollouts' row dim (B for `n=1` generations
    such as ReMax's greedy baseline, N otherwise)."""
    prim = primitive_name(node)
    if prim == "optimizer_step":
        return 0  # it reads no batch: the gradients are already there
    record = node.meta["spec"] if prim in GENERATORS else node.args[1].meta["spec"]
    record = record.items[0] if isinstance(record, S.TupleSpec) else record  # rollout: (Rollouts, episodes, rewards)
    return sizes[str(record.rows)] if isinstance(record, S.RecordSpec) else sizes["N"]


def state_on_host(group: Group, mesh: Mesh) -> bool:
    """Whether `group` keeps its training state in host memory (FSDP2's CPUOffloadPolicy). On a cpu
    mesh the devices are host memory already: nothing leaves them, so the device figures keep it."""
    return group.train is not None and group.train.cpu_offload and mesh.device != "cpu"


def micro_batching(node, rows: int, seq: int = 1) -> tuple[int, int]:
    """(rows per micro-batch, micro-batches per optimizer step) of the `update` node `node` on
    `rows` rows per rank of `seq` tokens: what the executor's accumulation loop runs. Packed
    (`micro_batch_tokens`): rows of full length (`seq`), the most a budget of tokens holds."""
    per_mini = -(-rows // node.kwargs["minibatches"])
    budget = node.kwargs.get("micro_batch_tokens")
    micro = min(budget // seq if budget else node.kwargs["micro_batch_size"] or per_mini, per_mini)
    return micro, -(-per_mini // micro)


def packed_tokens(node, rows: int, seq: int) -> int | None:
    """Tokens of the largest packed micro-batch of `node` on `rows` rows per rank of <= `seq`
    tokens: its budget, or all the mini-batch's tokens when they fit in it; None when not packed."""
    budget = node.kwargs.get("micro_batch_tokens")
    per_mini = -(-rows // node.kwargs.get("minibatches", 1))
    return None if budget is None else max(min(budget, per_mini * seq), 1)


def _train_config(node, group: Group, options: CompileOptions, rows: int, seq: int) -> M.TrainMemoryConfig:
    """How `group` trains for the `update` node `node` on `rows` rows per rank of `seq` tokens."""
    # An optimizer step holds the training state and no activations (no micro-batch).
    micro, count = micro_batching(node, rows, seq) if primitive_name(node) == "update" else (0, 1)
    tokens = (packed_tokens(node, rows, seq) if primitive_name(node) == "update" else None) or max(micro * seq, 1)
    dtype, offloaded = param_dtype(options.mesh), state_on_host(group, options.mesh)
    return M.TrainMemoryConfig(
        param_dtype=dtype, mixed_precision=dtype != torch.float32, fsdp_shards=group.train.fsdp,
        checkpointing=group.train.checkpointing, micro_batch_tokens=tokens, seq_len=seq,
        offload_params=offloaded, offload_optimizer=offloaded, lora=options.lora.get(node.args[0].meta["spec"].role),
        unsharded_grads=group.train.grad_sync_last and count > 1,
    )


def check_lora_roles(program: Program, options: CompileOptions) -> None:
    """Each `lora=` role must train in this program, and its model must have the targeted linears."""
    trained = sorted({node.args[0].meta["spec"].role for node in program.graph.nodes
                      if primitive_name(node) in ("update", "optimizer_step")})
    for role, lora in options.lora.items():
        if role not in trained:
            raise ConfigError(f"lora: role {role!r} does not train in this program{did_you_mean(role, trained)} "
                              f"(roles that train: {', '.join(trained) or 'none'}); its adapters would size nothing",
                              fix="key lora= by a role that rg.update trains, e.g. lora={'policy': {...}}")
        try:
            model_shape(options, role).lora_params(lora)
        except ValueError as error:
            raise ConfigError(f"lora[{role!r}]: {error}", fix="target the linear modules of that role's model") from None


def shares_lora_weights(options: CompileOptions, role: str, group: Group, groups: Sequence[Group]) -> bool:
    """Whether `role` is the reference of a LoRA policy on the policy's ranks: the executor runs it
    as the policy's module with adapters off (`rlgraph.backends.lora.reference_of`), holding nothing."""
    policy = next((other for other in groups if other.name == "policy"), None)
    return role == "ref" and "policy" in options.lora and policy is not None and set(group.ranks) <= set(policy.ranks)


def _phase_memory(program: Program, group: Group, options: CompileOptions,
                  groups: Sequence[Group] = ()) -> dict[str, M.MemoryBreakdown]:
    """The peak of each phase of `group`: the largest over the primitives of that phase (ReMax's two
    generations, two updates of one role), each sized by its own batch rows. Under `cpu_offload`
    the host's share is `host_memory`'s."""
    sizes = options.concrete(program.hparams.get("n"))
    dtype = param_dtype(options.mesh)
    phases: dict[str, M.MemoryBreakdown] = {}
    for node in _primitives(program, group):
        prim = primitive_name(node)
        role = node.args[0].meta["spec"].role
        shape = model_shape(options, role)
        prompt = sizes["P"] + image_tokens(options, role)  # a VLM's images are tokens of its prompts
        seq = prompt + sizes["T"]
        if prompt > sizes["P"] and (node.kwargs.get("micro_batch_tokens") or seq) < seq:
            raise ConfigError(f"micro_batch_tokens={node.kwargs['micro_batch_tokens']} is smaller than the longest "
                              f"row of role {role!r}: "
                              f"P={sizes['P']} + {prompt - sizes['P']} image tokens + T={sizes['T']} = {seq}",
                              fix=f"micro_batch_tokens >= {seq}, or a smaller pixel_budget")
        batch = batch_rows(node, sizes)
        rows = -(-batch // group.dp)
        if prim in ("update", "optimizer_step"):
            config = _train_config(node, group, options, rows, seq)
            packed = prim == "update" and node.kwargs.get("micro_batch_tokens") is not None
            phase, breakdown = "train", (M.packed_train_memory if packed else M.train_memory)(shape, config)
            micro = micro_batching(node, rows, seq)[0] if prim == "update" else 0
            breakdown += vision_memory(options, role, micro, training=True)
        elif prim == "rollout":  # multi-turn: each row's cache holds all its turns and observations
            phase, breakdown = "generate", rollout_memory(node, group, options, dtype)
        elif prim in GENERATORS:
            replicas = group.generate.dp
            phase, breakdown = "generate", M.generate_memory(shape, tp=group.generate.tp, batch_sequences=-(-batch // replicas),
                                                             max_seq_len=seq, dtype=dtype, prompt_len=prompt)
            # each prompt's images are encoded once for its n samples
            breakdown += vision_memory(options, role, -(-batch // (replicas * sizes["n"])), training=False)
        else:
            budget = packed_tokens(node, rows, seq)  # packed forwards of <= budget tokens, with their mask
            phase, breakdown = "infer", M.infer_memory(shape, batch_tokens=rows * seq, dtype=dtype, shards=len(group.ranks),
                                                       micro_batch_tokens=budget,
                                                       offload_params=state_on_host(group, options.mesh),
                                                       shared_weights=shares_lora_weights(options, role, group, groups))
            if budget is not None:
                breakdown += M.MemoryBreakdown(activations=M.packed_mask_bytes(budget, dtype))
            breakdown += vision_memory(options, role, budget // seq if budget else rows, training=False)
        if node.kwargs.get("vocab"):  # f32 logits and log-softmax [rows, T, V] at once (+ their gradient in training)
            held = micro_batching(node, rows, seq)[0] if prim == "update" else rows
            breakdown += M.MemoryBreakdown(activations=(3 if prim == "update" else 2) * 4 * held * sizes["T"] * shape.vocab)
        if phase not in phases or breakdown.total > phases[phase].total:
            phases[phase] = breakdown
    return phases


def rollout_memory(node, group: Group, options: CompileOptions, dtype: torch.dtype) -> M.MemoryBreakdown:
    """A rollout's memory on one generation replica: its share of the episodes, each with a KV cache
    of P + max_total_tokens (T when not given) tokens."""
    sizes = options.concrete(node.kwargs["n"])
    rows = -(-batch_rows(node, sizes) // group.generate.dp)
    return M.rollout_memory(model_shape(options, node.args[0].meta["spec"].role), tp=group.generate.tp, rows=rows,
                            prompt_len=sizes["P"], max_total_tokens=node.kwargs["max_total_tokens"] or sizes["T"],
                            dtype=dtype)


def _primitives(program: Program, group: Group) -> list:
    """The nodes of `group` that hold memory on its ranks (model primitives; not reward functions or filters)."""
    return [node for node in program.graph.nodes if primitive_name(node) not in (None, "score", "filter_groups")
            and node.meta.get("role") == group.name]


def host_memory(program: Program, group: Group, phases: dict[str, M.MemoryBreakdown],
                options: CompileOptions) -> M.MemoryBreakdown | None:
    """Per rank, what `group` keeps in host memory (None when nothing): its whole training state
    under `cpu_offload` (`train_host_memory`); else, where colocated offload steps take turns with
    its generator, what they park while it generates (the steps' bytes); and the generator's
    weights while a vLLM engine sleeps through training (its sleep level 1 keeps them in host memory)."""
    host = M.MemoryBreakdown()
    if state_on_host(group, options.mesh):
        sizes = options.concrete(program.hparams.get("n"))
        update = next(node for node in _primitives(program, group) if primitive_name(node) == "update")
        shape = model_shape(options, update.args[0].meta["spec"].role)
        config = _train_config(update, group, options, 1, sizes["P"] + sizes["T"])  # the host's share needs no micro-batch
        host += M.train_host_memory(shape, config)
    takes_turns = isinstance(options.placement, Colocated) and options.placement.offload and {"train", "generate"} <= set(phases)
    if takes_turns and options.mesh.device != "cpu":
        host += M.MemoryBreakdown() if state_on_host(group, options.mesh) else phases["train"].parked()
        if group.generate.engine == "vllm":
            host += M.MemoryBreakdown(params=phases["generate"].params)
    return host if host.total else None


def plan_memory(program: Program, groups: Sequence[Group],
                options: CompileOptions) -> tuple[dict[str, dict[str, dict[str, int]]], dict[str, dict[str, int]]]:
    """(group -> phase -> {part: bytes, total}, group -> host {part: bytes, total} per rank); raises
    `PlacementError` if a rank cannot hold its peak or a node's host memory what its ranks offload."""
    check_lora_roles(program, options)
    per_group = {group.name: _phase_memory(program, group, options, groups) for group in groups}
    host = {group.name: need for group in groups if (need := host_memory(program, group, per_group[group.name], options))}
    by_ranks: dict[tuple[int, ...], dict[str, M.MemoryBreakdown]] = {}
    for group in groups:
        for phase, breakdown in per_group[group.name].items():
            by_ranks.setdefault(group.ranks, {})[f"{group.name}.{phase}"] = breakdown
    offload = bool(getattr(options.placement, "offload", False))
    for ranks, phases in by_ranks.items():
        moments = M.colocated_moments(phases, offload=offload)
        moment = max(moments, key=lambda name: moments[name].total)
        roles = "+".join(sorted({name.split(".")[0] for name in phases}))
        when = _moment_text(moment, phases, offload) if len(phases) > 1 else ""
        M.check_fits(roles, ranks[0], moments[moment], options.mesh.capacity_bytes, when=when,
                     one_row_micro_batches=_one_row_micro_batches(program, [g for g in groups if g.ranks == ranks], options))
    _check_host(groups, host, options.mesh)  # after the devices: a device that cannot fit is the first thing to fix
    memory = {name: {phase: breakdown.as_dict() for phase, breakdown in phases.items()} for name, phases in per_group.items()}
    return memory, {name: need.as_dict() for name, need in host.items()}


def _one_row_micro_batches(program: Program, groups: Sequence[Group], options: CompileOptions) -> bool:
    """Whether every update the groups train runs micro-batches of one row (there is no smaller one)."""
    sizes = options.concrete(program.hparams.get("n"))
    rows = [micro_batching(node, -(-batch_rows(node, sizes) // group.dp), sizes["P"] + sizes["T"])[0]
            for group in groups if group.train is not None
            for node in _primitives(program, group) if primitive_name(node) == "update"]
    return bool(rows) and max(rows) <= 1


def defer_grad_sync(program: Program, groups: Sequence[Group], options: CompileOptions) -> tuple[Group, ...]:
    """`groups` with `grad_sync_last` on every FSDP-sharded trainer that accumulates over several
    micro-batches, where the unsharded gradient that costs fits in memory the plan reserves for its
    ranks anyway: their train phase stays at or below the largest phase peak they had before (the
    generator's KV cache on colocated ranks, typically). Reduce-scattering once per optimizer step
    instead of once per micro-batch saves a third of the per-micro-batch FSDP traffic, but holding
    a full fp32 gradient per rank is often the largest buffer of the step: it is never bought with
    memory the plan did not already need. Under `cpu_offload` the device has no room by construction."""
    sizes = options.concrete(program.hparams.get("n"))
    chosen = list(groups)
    for index, group in enumerate(groups):
        layout = group.train
        if layout is None or layout.fsdp < 2 or layout.cpu_offload:
            continue
        updates = [node for node in _primitives(program, group) if primitive_name(node) == "update"]
        seq = sizes["P"] + sizes["T"]
        if not any(micro_batching(node, -(-batch_rows(node, sizes) // group.dp), seq)[1] > 1 for node in updates):
            continue
        sharing = [other for other in groups if set(other.ranks) & set(group.ranks)]
        reserved = max(need.total for other in sharing for need in _phase_memory(program, other, options, groups).values())
        deferred = attrs.evolve(group, train=attrs.evolve(layout, grad_sync_last=True))
        if _phase_memory(program, deferred, options, groups)["train"].total <= reserved:
            chosen[index] = deferred
    return tuple(chosen)


def _moment_text(moment: str, phases: dict[str, M.MemoryBreakdown], offload: bool) -> str:
    """When ranks shared by several phases peak: `policy.train runs; critic.train, ... keep their resident state`."""
    others = sorted(name for name in phases if name != moment)
    verb = "keeps" if len(others) == 1 else "keep"
    kept = ("weights, gradients, optimizer state and KV cache" if not offload else
            "what offload=True leaves on the device (it parks only the generating trainer's gradients and optimizer state)")
    return f"{moment} runs; {', '.join(others)} {verb} {kept}"


def _check_host(groups: Sequence[Group], host: dict[str, M.MemoryBreakdown], mesh: Mesh) -> None:
    """Each node's host memory must hold what every rank on it offloads (ranks of a node share it)."""
    capacity = mesh.host_capacity_bytes
    if capacity is None or not host:
        return
    for node in range(mesh.nodes):
        on_node = {rank for rank in range(mesh.size) if mesh.node_of(rank) == node}
        held = {group.name: (host[group.name], len(on_node.intersection(group.ranks))) for group in groups
                if group.name in host and on_node.intersection(group.ranks)}
        M.check_host_fits(node, held, capacity)
