"""`place`: map roles to worker groups (ranks + per-phase layouts) and check memory fits.

Colocated: every role on every rank; the policy trains with FSDP2 over `fsdp` ranks and generates
with `tp`-way tensor parallel replicas. Split: each named group gets its own ranks (a count, an
explicit list, or the name of a group to share). Explicit: groups as given. Every generation
layout names its engine (`CompileOptions.engine`, "auto" resolved for the mesh).

Guarantees: `annotations["groups"]` holds one `Group` per role the program uses (the controller
excepted), ranks inside the mesh, layouts dividing their group; `annotations["memory"]` holds the
per-rank memory of every group and phase, `annotations["host_memory"]` what a rank of a group keeps
in host memory (offloaded training state), and a placement that cannot fit (a rank's device, or a
node's host memory) raises `PlacementError` naming the role, the rank, what it needs and what it
has. A layout no executor can run (tensor parallel generation on the native engine, which runs
tp=1 only), or an option of the wrong type (`cpu_offload="yes"`), raises `PlacementConfigError`
naming the option to change.
A placement's `cpu_offload` reaches the train layout of every group that trains. An FSDP trainer
that accumulates over several micro-batches syncs its gradients once, after the last one, where
the memory model says the unsharded gradient that needs still fits (`TrainLayout.grad_sync_last`).
With `env_workers=k` every rollout node carries `meta["env_workers"]`, which the runtime passes to the
executor's `rollout`: its environments step in k worker processes of each generating rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from rlgraph.errors import ConfigError, did_you_mean
from rlgraph.ir.primitives import primitive_name
from rlgraph.ir.program import Program, copy_program
from rlgraph.ir.entrypoints import DEFAULT_ROLES
from rlgraph.passes.options import CompileOptions, PlacementConfigError, check_engine
from rlgraph.plan.layouts import CONTROLLER
from rlgraph.plan.mesh import Colocated, Explicit, GenerateLayout, Group, Placement, Split, TrainLayout


KNOWN_ROLES = {*DEFAULT_ROLES, "rollout"}  # "rollout": the policy's generator in a split


def roles_used(program: Program) -> dict[str, set[str]]:
    """role -> phases it runs (generate, infer, train, reward, math, input)."""
    used: dict[str, set[str]] = {}
    for node in program.graph.nodes:
        role = node.meta.get("role")
        if role and role != CONTROLLER:
            used.setdefault(role, set()).add(node.meta["phase"])
    return used


def _check_divides(what: str, degree: int, size: int, group: str) -> None:
    if not isinstance(degree, int) or degree < 1 or size % degree:
        divisors = [d for d in range(1, size + 1) if size % d == 0]
        raise PlacementConfigError(f"group {group!r} has {size} ranks, which {what}={degree!r} does not divide; "
                                   f"{what} must be one of {divisors}")


def _check_flag(option: str, value: object, where: str, fix: str) -> None:
    """Refuse a non-bool where a flag is needed (`cpu_offload="yes"` would otherwise read as true)."""
    if not isinstance(value, bool):
        raise PlacementConfigError(f"{where}: {option} must be True or False, got {value!r}\n  fix: {fix}")


GRAD_SYNC = ("auto", "each", "last")


def _check_grad_sync(value: object, where: str) -> None:
    if not isinstance(value, str) or value not in GRAD_SYNC:
        raise PlacementConfigError(
            f"{where}: grad_sync must be one of {', '.join(map(repr, GRAD_SYNC))}, got {value!r}\n  fix: 'each' "
            "reduce-scatters every micro-batch's gradients, 'last' once per optimizer step (one unsharded gradient "
            "per rank), 'auto' picks 'last' where that fits in memory the plan reserves anyway")


def _layouts(name: str, ranks: tuple[int, ...], phases: set[str], tp: int, fsdp: int | None, ckpt: bool,
             cpu_offload: bool = False, grad_sync: str = "auto") -> Group:
    size = len(ranks)
    train = generate = None
    if "train" in phases:
        shard = size if fsdp is None else fsdp  # not `fsdp or size`: fsdp=0 is a mistake, refused below
        _check_divides("fsdp", shard, size, name)
        train = TrainLayout(shard, size // shard, ckpt, cpu_offload, grad_sync_last=grad_sync == "last")
    if "generate" in phases:
        _check_divides("tp", tp, size, name)
        generate = GenerateLayout(tp, size // tp)
    return Group(name, ranks, train, generate, infer_dp=size)


def _colocated(used: dict[str, set[str]], placement: Colocated, size: int) -> list[Group]:
    ranks = tuple(range(size))
    _check_flag("cpu_offload", placement.cpu_offload, "rg.colocated",
                "rg.colocated(cpu_offload=True) (--placement colocated:cpu_offload=True), or False")
    _check_grad_sync(placement.grad_sync, "rg.colocated")
    return [_layouts(role, ranks, phases, placement.tp, placement.fsdp, placement.checkpointing, placement.cpu_offload,
                     placement.grad_sync) for role, phases in sorted(used.items())]


def _split(used: dict[str, set[str]], placement: Split, size: int) -> list[Group]:
    _check_split_names(used, placement)
    assigned = _assign_ranks(placement, size)
    missing = sorted(set(used) - set(assigned))
    if missing:
        raise PlacementConfigError(
            f"split{dict(placement.groups)} gives no ranks to role(s) {', '.join(missing)}; "
            f"add them or share a group, e.g. {{{missing[0]!r}: 'policy'}}"
        )
    _check_flag("cpu_offload", placement.cpu_offload, "rg.split",
                "rg.split({...}, cpu_offload=True) (--placement split:...,cpu_offload=True), or False")
    _check_grad_sync(placement.grad_sync, "rg.split")
    return [_layouts(role, assigned[role], used[role], placement.tp, None, placement.checkpointing, placement.cpu_offload,
                     placement.grad_sync) for role in sorted(used)]


def _check_split_names(used: dict[str, set[str]], placement: Split) -> None:
    """A group must be named after a role: a typo (`rolout`) would leave its ranks idle while the
    real role is refused or squeezed. A known role the program does not run is accepted, so one
    split serves several algorithms (SFT has no `rollout`, GRPO no `critic`)."""
    for name in placement.groups:
        if name not in used and name not in KNOWN_ROLES:
            known = sorted(set(used) | KNOWN_ROLES)
            raise PlacementConfigError(f"split: group {name!r} is no role{did_you_mean(name, known)} (this program "
                                       f"runs {', '.join(sorted(used))})\n  fix: name each group after a role "
                                       f"({', '.join(known)}); 'rollout' is the policy's generator")


def _assign_ranks(placement: Split, size: int) -> dict[str, tuple[int, ...]]:
    """group -> its ranks: counts are laid out in order, lists taken as given, names shared.
    Refuses ranks outside the mesh, repeated within a group or given to two groups of their own."""
    assigned: dict[str, tuple[int, ...]] = {}
    next_rank = 0
    for name, spec in placement.groups.items():
        if isinstance(spec, bool) or not isinstance(spec, (int, str, list, tuple, range)):
            raise PlacementConfigError(f"split: group {name!r} = {spec!r}; give a count of ranks, a list of ranks or "
                                       "the name of a group to share")
        if isinstance(spec, int):
            assigned[name] = tuple(range(next_rank, next_rank + spec))
            next_rank += spec
        elif not isinstance(spec, str):
            assigned[name] = tuple(spec)
    owner: dict[int, str] = {}
    for name, ranks in assigned.items():
        outside = [rank for rank in ranks if not isinstance(rank, int) or not 0 <= rank < size]
        if outside or not ranks:
            raise PlacementConfigError(f"split: group {name!r} asks for ranks {list(ranks)}, but the mesh has ranks 0-{size - 1}")
        if len(set(ranks)) != len(ranks):
            raise PlacementConfigError(f"split: group {name!r} lists a rank twice: {list(ranks)}\n"
                                       "  fix: give each rank once")
        for rank in ranks:
            if rank in owner:  # two groups of their own on one rank: the plan would count its memory once
                raise PlacementConfigError(f"split: rank {rank} is given to both {owner[rank]!r} and {name!r}\n"
                                           f"  fix: give them disjoint ranks, or share one group: {{{name!r}: {owner[rank]!r}}}")
            owner[rank] = name
    for name, spec in placement.groups.items():
        if isinstance(spec, str):
            if spec not in assigned:
                raise PlacementConfigError(f"split: group {name!r} shares {spec!r}, which has no ranks of its own")
            assigned[name] = assigned[spec]
    return assigned


def _with_trained(used: dict[str, set[str]], trained: tuple[str, ...]) -> dict[str, set[str]]:
    """`used` with a train phase for each role of `trained` (another plan trains it on these workers),
    each checked to be a role of this program that it reads."""
    out = {role: set(phases) for role, phases in used.items()}
    for role in trained:
        if not isinstance(role, str) or role not in used:
            readable = sorted(used)
            raise PlacementConfigError(
                f"trained={trained!r}: {role!r} is no role of this program{did_you_mean(str(role), readable)} (it "
                f"runs {', '.join(readable) or 'no model role'})\n  fix: name the roles it reads that another plan "
                "trains on the same workers, e.g. trained=('policy',)")
        out[role].add("train")
    return out


def resolve_groups(program: Program, options: CompileOptions) -> tuple[Group, ...]:
    used = _with_trained(roles_used(program), options.trained)
    placement = options.placement
    if isinstance(placement, Colocated):
        groups = _colocated(used, placement, options.mesh.size)
    elif isinstance(placement, Split):
        groups = _split(used, placement, options.mesh.size)
    elif isinstance(placement, Explicit):
        groups = list(placement.groups)
        for group in groups:
            if group.train is not None:
                _check_flag("cpu_offload", group.train.cpu_offload, f"group {group.name!r}'s TrainLayout",
                            "TrainLayout(..., cpu_offload=True), or False")
        missing = sorted(set(used) - {group.name for group in groups})
        if missing:
            raise PlacementConfigError(f"explicit placement has no group for role(s) {', '.join(missing)}")
    else:
        raise PlacementConfigError(f"unknown placement {placement!r}; use rg.colocated(), rg.split({{...}}) or rg.explicit(...)")
    multi_turn = {node.meta.get("role") for node in program.graph.nodes if primitive_name(node) == "rollout"}
    return tuple(_multi_turn_engine(_with_engine(group, options), options) if group.name in multi_turn
                 else _with_engine(group, options) for group in groups)


def _multi_turn_engine(group: Group, options: CompileOptions) -> Group:
    """A group that runs `rg.rollout` with engine "auto" and tp=1 generates with the native engine
    (each row continues from its own KV cache); vLLM, asked for, runs the episodes through its
    prefix cache (`rlgraph.backends.vllm.multiturn`)."""
    layout = group.generate
    if layout is not None and layout.engine == "vllm" and options.engine == "auto" and layout.tp == 1:
        return attrs.evolve(group, generate=attrs.evolve(layout, engine="native"))
    return group


def _with_engine(group: Group, options: CompileOptions) -> Group:
    """`group` with its generation engine named; refused if that engine cannot run its layout."""
    layout = group.generate
    if layout is None:
        return group
    own = None if layout.engine in (None, "auto") else layout.engine  # an explicit layout may name its engine
    if own is not None:
        check_engine(own, options.mesh)
        if options.engine not in ("auto", own):
            raise PlacementConfigError(f"role {group.name!r}: its layout names engine {own!r}, but engine="
                                       f"{options.engine!r} was asked for; drop one of the two")
    engine = own or options.generation_engine
    if engine == "native" and layout.tp > 1:
        why, vllm = (("its layout names engine 'native'", "engine='vllm' in its GenerateLayout") if own else
                     (f"engine={options.engine!r} on the mesh {options.mesh}", "engine='vllm' (--engine vllm)"))
        raise PlacementConfigError(
            f"role {group.name!r}: generate tp={layout.tp} needs an engine with tensor parallelism; the native engine "
            f"runs tp=1 only ({why})\n  fix: {_tp1_fix(options.placement, group)}, or {vllm} on a GPU mesh")
    return attrs.evolve(group, generate=attrs.evolve(layout, engine=engine))


def _tp1_fix(placement: Placement, group: Group) -> str:
    """How to ask for tp=1 in the placement the user wrote (Python, then the CLI's --placement)."""
    if isinstance(placement, Colocated):
        return "rg.colocated(tp=1) (--placement colocated:tp=1)"
    if isinstance(placement, Split):
        return "rg.split({...}, tp=1) (--placement split:...,tp=1)"
    return f"GenerateLayout(tp=1, dp={len(group.ranks)}) for group {group.name!r}"


def check_model_roles(program: Program, options: CompileOptions) -> None:
    """A `models=` key that is no role would be ignored and the default model sized instead: refuse it."""
    known = set(roles_used(program)) | KNOWN_ROLES
    for role in options.models:
        if role not in known:
            raise PlacementConfigError(f"models: {role!r} is no role{did_you_mean(role, sorted(known))}; its model "
                                       f"would be ignored and the default sized instead\n"
                                       f"  fix: key models= by role: {', '.join(sorted(known))}")


def place(program: Program, options: CompileOptions) -> Program:
    from rlgraph.passes.memory_plan import defer_grad_sync, plan_memory  # the memory model is its own module

    check_model_roles(program, options)
    if options.env_workers is not None and not any(primitive_name(node) == "rollout" for node in program.graph.nodes):
        raise ConfigError(f"env_workers={options.env_workers} but {program.name} never calls rg.rollout: there are no "
                          "environments to step", fix="leave env_workers out (None) for an algorithm without rg.rollout")
    groups = resolve_groups(program, options)
    memory, host_memory = plan_memory(program, groups, options)  # a placement that cannot fit is refused as given
    deferred = defer_grad_sync(program, groups, options) if getattr(options.placement, "grad_sync", "each") == "auto" else groups
    if deferred != groups:
        groups, (memory, host_memory) = deferred, plan_memory(program, deferred, options)
    out, _ = copy_program(program, annotations={**program.annotations, "groups": groups, "memory": memory,
                                                "host_memory": host_memory})
    deferring = {group.name for group in groups if group.train is not None and group.train.grad_sync_last}
    for node in out.graph.nodes:  # the executor reads it with the update's other settings
        if primitive_name(node) == "update" and node.meta.get("role") in deferring:
            node.meta["grad_sync_last"] = True
        if primitive_name(node) == "rollout" and options.env_workers is not None:  # where its env steps run
            node.meta["env_workers"] = {"env_workers": options.env_workers, "env_memory_mb": options.env_memory_mb}
    return out.verify(after="place")


def group_named(groups: Sequence[Group], name: str) -> Group:
    return next(group for group in groups if group.name == name)
