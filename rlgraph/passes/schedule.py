"""`schedule`: lower the placed, resharded program to the ordered `Plan`.

Consecutive nodes of one group and phase form a stage; each transfer and weight sync is its own
step. Program order is kept (it respects data dependencies by construction), and the plan's steps
name the program nodes they run, every node in exactly one step, so an executor walking the plan
runs exactly the program.

Reads (`ro.mask`, or one output of a multi-output primitive) are not work on a worker, so a read
never gives a stage its phase. It joins the stage of its group next to it: the one after it, whose
work it feeds (`[8] train @policy logprobs=.logprobs  mask=.mask  update=update`, as the printed
program puts `f = a.logprobs` above the `update` that reads it), else the one before it; an unpack
stays with its primitive. Reads with no stage of their group on either side (a transfer or another
group's step around them) form a `fields` stage. This keeps the printed plan one line per piece
of work, each labelled with the work it does, without a line for every read.

A refill loop (`filter_groups`) becomes a `Loop` over the steps of its region; no stage mixes
nodes inside and outside a loop, so a step either re-runs whole or not at all. A colocated group
that both generates and trains offloads its optimizer state and gradients right before the stage
that runs `generate` and onloads them right before the stage that runs its next `update`.

With `staleness` >= 1 the plan also carries its `Overlap`: each step's lane (`overlap.step_lanes`),
the order one iteration issues them in, and whether the lanes' groups are disjoint (on shared ranks
they take turns, and the plan says which split would let them overlap).
"""

from __future__ import annotations

import operator

import torch.fx as fx

from rlgraph.ir import specs as S
from rlgraph.ir.primitives import GENERATORS, primitive_name
from rlgraph.ir.printer import op_name
from rlgraph.ir.program import Program
from rlgraph.ir.infer import get_field
from rlgraph.passes.memory_plan import vision_facts
from rlgraph.passes.options import CompileOptions
from rlgraph.plan.layouts import CONTROLLER
from rlgraph.plan.memory import PARKED
from rlgraph.plan.mesh import Colocated
from rlgraph.plan.plan import Loop, Offload, Overlap, Plan, Stage, SyncWeights, Transfer


def _role_phase(node: fx.Node) -> tuple[str, str]:
    """A work node's role and phase; math on the controller is labelled `controller`."""
    phase = node.meta["phase"]
    return node.meta["role"], ("controller" if phase == "math" and node.meta["role"] == CONTROLLER else phase)


def _loop_steps(program: Program, steps: list) -> tuple[Loop, ...]:
    """The plan's loops: the steps that run each refill region's nodes, and the filter's step."""
    step_of: dict[str, int] = {}
    for step in steps:
        if isinstance(step, Stage):
            step_of.update({name: step.index for name in step.nodes})
    step_of.update({node.name: node.meta["step"] for node in program.graph.nodes if "step" in node.meta})
    return tuple(Loop(tuple(sorted({step_of[name] for name in loop.nodes})), step_of[loop.filter], loop.prompts,
                      loop.max_rounds) for loop in program.annotations.get("loops", ()))


def _detail(node: fx.Node, program: Program, options: CompileOptions, sizes: dict[str, int]) -> tuple[str, float]:
    from rlgraph.passes.memory_plan import batch_rows, image_tokens, model_shape, pixel_budget

    prim = primitive_name(node)
    groups = {group.name: group for group in program.annotations["groups"]}
    if prim == "score" and node.meta["role"] == CONTROLLER:
        return options.reward_pool, 0.0
    if prim is None or prim == "score":
        return "", 0.0
    if prim == "filter_groups":
        return f"keep the groups where keep is True; refill to B={sizes['B']} groups from fresh prompts", 0.0
    group = groups[node.meta["role"]]
    role = node.args[0].meta["spec"].role
    shape = model_shape(options, role)
    batch = batch_rows(node, sizes)  # B for an n=1 generation, N otherwise
    seq = sizes["P"] + image_tokens(options, role) + sizes["T"]  # a VLM's image tokens lengthen every row
    tokens = batch * seq
    # the vision tower's forward FLOPs of one prompt's images (0 for a text model)
    images = 0.0 if shape.vision is None else options.images_per_prompt * shape.vision.flops_per_image(
        pixel_budget(options), training=False)
    if prim == "generate":
        layout = group.generate
        samples = sizes["B"] * node.kwargs["n"]  # this generate's own n (a greedy baseline has n=1)
        per_replica = -(-samples // layout.dp)
        flops = shape.flops_per_token(seq, training=False) * samples * seq + sizes["B"] * images  # once a prompt
        return (f"{samples} samples ({sizes['B']} prompts x n={node.kwargs['n']}), <= {sizes['T']} new tokens"
                f"{_sampling_text(node.kwargs)}; {layout.dp} replica(s) x tp={layout.tp}, {per_replica} sequences each"), flops
    if prim == "rollout":
        return _rollout_text(node, group, options, sizes), flops_of_generation(shape, node, sizes)
    if prim in ("logprobs", "values"):
        packed = f", packed in micro-batches of <= {budget} tokens" if (budget := node.kwargs.get("micro_batch_tokens")) else ""
        return (f"forward only, {-(-batch // group.dp)} sequences/rank{packed}",
                shape.flops_per_token(seq, training=False) * tokens + batch * images)
    kwargs = node.kwargs
    if prim == "optimizer_step":
        settings = " ".join(f"{key}={kwargs[key]}" for key in ("lr", "betas", "eps", "weight_decay") if kwargs[key] is not None)
        return f"apply the accumulated gradients {settings or '(optimizer settings kept)'}; grad clip {kwargs['grad_clip']}", 0.0
    rows = -(-batch // group.dp)
    per_mini = -(-rows // kwargs["minibatches"])
    micro = kwargs["micro_batch_size"] or per_mini
    count = -(-per_mini // micro)
    loss = node.meta["program"].name
    micros = f"{count} micro-batch(es) of {min(micro, per_mini)} rows/rank"
    if kwargs.get("micro_batch_tokens"):
        micros = _packed_text(kwargs["micro_batch_tokens"], per_mini, seq)
    text = (f"loss {loss}: {kwargs['epochs']} epoch(s) x {kwargs['minibatches']} minibatch(es) x {micros}; "
            f"grad clip {kwargs['grad_clip']}"
            + ("; gradients accumulated, no optimizer step" if not kwargs.get("step", True) else "")
            + ("; per-token outputs returned" if kwargs.get("outputs") else ""))
    tower = 3 if shape.train_vision else 1  # a frozen tower runs forward only
    return text, (shape.flops_per_token(seq, training=True) * tokens + tower * batch * images) * kwargs["epochs"]


def _packed_text(budget: int, rows: int, seq: int) -> str:
    """Packed micro-batches of a mini-batch of `rows` rows/rank of <= `seq` tokens each: their
    token budget, and how many a full-length mini-batch makes (ragged rows pack into fewer)."""
    per_micro = min(budget // seq, rows)
    count = -(-rows // per_micro)
    return (f"packed micro-batches of <= {budget} tokens/rank, no padding (at full length P+T={seq}: {count} micro-batch(es) of "
            f"{per_micro} rows = {per_micro * seq} tokens; shorter rows pack into fewer)")


def flops_of_generation(shape, node: fx.Node, sizes: dict[str, int]) -> float:
    """Forward FLOPs of sampling B*n sequences of P + T tokens (a rollout's observations included)."""
    samples = sizes["B"] * node.kwargs["n"]
    return shape.flops_per_token(sizes["P"] + sizes["T"], training=False) * samples * (sizes["P"] + sizes["T"])


def _rollout_text(node: fx.Node, group, options: CompileOptions, sizes: dict[str, int]) -> str:
    """A rollout stage: its episodes, turn budgets, the KV cache they keep across turns, and where and
    how long the environment's steps run."""
    from rlgraph.passes.memory_plan import param_dtype, rollout_memory
    from rlgraph.plan.memory import format_bytes

    kwargs, layout = node.kwargs, group.generate
    cache = rollout_memory(node, group, options, param_dtype(options.mesh)).kv_cache
    samples = sizes["B"] * kwargs["n"]
    per_turn = kwargs["max_tokens_per_turn"] or sizes["T"]
    timeout = "no timeout" if kwargs["step_timeout"] is None else f"timeout {kwargs['step_timeout']:g} s"
    env = node.args[1].target if node.args[1].op == "placeholder" else node.args[1].name
    return (f"{samples} episodes ({sizes['B']} prompts x n={kwargs['n']}), <= {kwargs['max_turns']} turns x <= {per_turn} "
            f"tokens, <= {sizes['T']} response tokens (policy + observations){_sampling_text({**kwargs, 'stop': ()})}; "
            f"{layout.dp} replica(s) x tp={layout.tp}; between turns env {env!r}.step per row {_env_place(options)}, "
            f"concurrently, {timeout}; {_continuation(layout.engine)} "
            f"({format_bytes(cache)}/replica: {-(-samples // layout.dp)} rows x (P + {kwargs['max_total_tokens'] or sizes['T']}) tokens)")


def _continuation(engine: str | None) -> str:
    """How a row's next turn reuses the earlier ones: its own KV cache (native), or vLLM's prefix cache."""
    if engine == "vllm":
        return "each turn sends the row's context as token ids to vLLM, whose prefix cache holds the earlier turns"
    return "each row continues from its KV cache"


def _env_place(options: CompileOptions) -> str:
    """Where a rollout's environment steps run: the generating rank's process, or its env workers."""
    if options.env_workers is None:
        return "in the generating rank's process"
    count = options.env_workers
    return (f"in {count} env worker process{'es' if count > 1 else ''} per generating rank ({options.env_memory_mb} "
            "MiB each; a step past the timeout or a dead worker ends the episode, counted in env/env_errors)")


def _sampling_text(kwargs: dict) -> str:
    """How a generate step samples, where it is not the plain default: ", top_p 0.9, stop after '\\n\\n'"."""
    parts = [f"temperature {kwargs['temperature']}" if kwargs["temperature"] not in (0, 1) else "",
             f"top_p {kwargs['top_p']}" if kwargs["top_p"] != 1 else "",
             f"stop after {' or '.join(map(repr, kwargs['stop']))}" if kwargs.get("stop") else ""]
    return "".join(f", {part}" for part in parts if part)


def _kernel_text(node: fx.Node) -> str | None:
    """The fused kernel a node runs, or why its op's kernel declined it."""
    return node.meta.get("kernel", node.meta.get("kernel_declined"))


def _kernels(node: fx.Node) -> list[str]:
    found = [text] if (text := _kernel_text(node)) else []
    if "program" in node.meta:
        program = node.meta["program"]
        found += [f"{text} (in {program.name})" for n in program.graph.nodes if (text := _kernel_text(n))]
    return found


Key = tuple[str, str, bool]  # (group, phase, inside a refill loop): consecutive nodes with one key form a stage


def _is_unpack(node: fx.Node) -> bool:
    """One output of a multi-output primitive (`update`'s new version and stats, `filter_groups`'s results)."""
    return node.target is operator.getitem and (isinstance(node.meta["spec"], (S.ModelSpec, S.StatsSpec))
                                                or isinstance(node.args[0].meta.get("spec"), S.TupleSpec))


def _is_read(node: fx.Node) -> bool:
    """A read of a record's field or of a primitive's output: bookkeeping, no work on a worker."""
    return node.target is get_field or _is_unpack(node)


def _stage_keys(nodes: list[fx.Node], region: set[str]) -> dict[fx.Node, Key | None]:
    """Each node's stage key; None for a transfer or a weight sync (each a step of its own).

    Work nodes are keyed by their role and phase. An unpack right after its primitive stays in the
    primitive's stage. Any other read joins the stage of its group next to it: the one after it
    (whose work it feeds), else the one before it; with neither, it is a `fields` stage.
    """
    keys: dict[fx.Node, Key | None] = {}
    for before, node in zip([None, *nodes], nodes):
        if node.meta.get("transfer") or node.meta.get("sync"):
            keys[node] = None
        elif _is_unpack(node) and keys.get(before) and _follows_its_primitive(node, before):
            keys[node] = keys[before]  # `h i = update ...` prints as one line: one stage
        elif not _is_read(node):
            keys[node] = (*_role_phase(node), node.name in region)
    after: Key | None = None
    for node in reversed(nodes):  # a run of reads takes the key of the work after it ...
        if node not in keys and _same_group(after, node, region):
            keys[node] = after
        after = keys.get(node)
    before: Key | None = None
    for node in nodes:  # ... else of the work before it
        if node not in keys:
            fields = (node.meta["role"], "fields", node.name in region)
            keys[node] = before if _same_group(before, node, region) else fields
        before = keys[node]
    return keys


def _follows_its_primitive(unpack: fx.Node, before: fx.Node) -> bool:
    """Whether `before` is the unpack's primitive or another unpack of it."""
    return before is unpack.args[0] or (_is_unpack(before) and before.args[0] is unpack.args[0])


def _same_group(key: Key | None, node: fx.Node, region: set[str]) -> bool:
    """Whether `node` may join a stage keyed `key`: same group, same side of a refill loop."""
    return key is not None and (key[0], key[2]) == (node.meta["role"], node.name in region)


def _segments(nodes: list[fx.Node], keys: dict[fx.Node, Key | None]) -> list[list[fx.Node]]:
    """Program order cut into runs of one stage key; a transfer or sync is a run of its own."""
    runs: list[list[fx.Node]] = []
    for node in nodes:
        if keys[node] is None or not runs or keys[runs[-1][0]] != keys[node]:
            runs.append([node])
        else:
            runs[-1].append(node)
    return runs


def _op_text(node: fx.Node, stage: list[fx.Node]) -> str | None:
    if node.target is get_field:
        return f"{node.name}=.{node.args[1]}"
    if _is_unpack(node):  # shown by its primitive's line when they share the stage
        return None if node.args[0] in stage else f"{node.name}={node.args[0].name}[{node.args[1]}]"
    return f"{node.name}={op_name(node)}"


def _stage(index: int, key: Key, nodes: list[fx.Node], program: Program, options: CompileOptions,
           sizes: dict[str, int]) -> Stage:
    details = [_detail(node, program, options, sizes) for node in nodes]
    ops = [_op_text(node, nodes) for node in nodes]
    return Stage(index, key[0], key[1], tuple(node.name for node in nodes), tuple(op for op in ops if op),
                 "; ".join(text for text, _ in details if text), sum(flops for _, flops in details),
                 tuple(kernel for node in nodes for kernel in _kernels(node)))


def _step(node: fx.Node, index: int) -> Transfer | SyncWeights:
    """The step of a transfer or weight-sync node; the node remembers its step."""
    kw = node.kwargs
    node.meta["step"] = index
    if node.meta.get("transfer"):
        return Transfer(index, kw["kind"], node.args[0].name, str(node.meta["spec"]), kw["src"], kw["dst"],
                        kw["nbytes"])
    return SyncWeights(index, node.args[0].meta["spec"].role, str(node.meta["spec"]), kw["src"], kw["dst"],
                       kw["nbytes"], kw["buckets"])


def schedule(program: Program, options: CompileOptions) -> Plan:
    sizes = options.concrete(program.hparams.get("n"))
    memory = program.annotations["memory"]
    region = {name for loop in program.annotations.get("loops", ()) for name in loop.nodes}
    nodes = [node for node in program.graph.nodes if node.op not in ("placeholder", "output")]
    keys = _stage_keys(nodes, region)
    offload = isinstance(options.placement, Colocated) and options.placement.offload
    steps: list = []
    offloaded: set[str] = set()
    for run in _segments(nodes, keys):
        if keys[run[0]] is None:
            steps.append(_step(run[0], len(steps)))
            continue
        if offload:
            steps.extend(_offload_points(run, len(steps), memory, offloaded, options.generation_engine))
        steps.append(_stage(len(steps), keys[run[0]], run, program, options, sizes))
    return Plan(program.name, options.mesh, _placement_text(options), program.annotations["groups"],
                {k: sizes[k] for k in ("B", "n", "N", "P", "T")}, tuple(steps), memory, _notes(options),
                _loop_steps(program, steps), host_memory=program.annotations.get("host_memory", {}),
                overlap=_overlap(program, steps, options) if options.staleness else None,
                vision=vision_facts(program, options))


def _overlap(program: Program, steps: list, options: CompileOptions) -> Overlap:
    """The lanes of the plan's steps and the order one iteration issues them in: the rollout steps
    of batch i+k up to the first that waits for an answer from the workers (a gather to the
    controller, a refill loop), then batch i's train steps, then the rest of the rollout lane."""
    from rlgraph.passes.overlap import step_lanes

    lanes = step_lanes(program, steps)
    rollout = tuple(step.index for step in steps if lanes[step.index] == "rollout")
    train = tuple(step.index for step in steps if lanes[step.index] == "train")
    filters = {loop.filter_step for loop in _loop_steps(program, steps)}  # a refill round waits for the filter
    waits = [position for position, index in enumerate(rollout)
             if index in filters or (isinstance(steps[index], Transfer) and steps[index].dst == CONTROLLER)]
    split = waits[0] if waits else len(rollout)

    def groups(indices: tuple[int, ...]) -> tuple[str, ...]:
        """The worker groups a lane keeps busy (a stage of reads only does no work)."""
        names = [getattr(steps[i], "group", None) for i in indices if getattr(steps[i], "phase", "") != "fields"]
        return tuple(dict.fromkeys(name for name in names if name and name != CONTROLLER))

    rollout_groups, train_groups = groups(rollout), groups(train)
    by_name = {group.name: group for group in program.annotations["groups"]}

    def ranks(names) -> set[int]:
        return {rank for name in names for rank in by_name[name].ranks}

    generating = groups(tuple(i for i in rollout if getattr(steps[i], "phase", "") == "generate"))
    training = ranks(train_groups)
    shared, other = sorted(ranks(generating) & training), sorted(ranks(rollout_groups) & training)
    role = [*program.primitive_nodes("generate"), *program.primitive_nodes("rollout")][0].args[0].meta["spec"].role
    if shared:
        fix = (f"give generation ranks of its own, e.g. placement=split({_even_split(options, train_groups)}), or "
               "placement='auto', which ranks splits by the overlapped step time") if isinstance(options.placement, Colocated) \
            else "the train lane's work there reads values that live on the generator's ranks"
        note = (f"nothing to overlap: generation runs on rank(s) {', '.join(map(str, shared))}, where the train lane also "
                f"works ({', '.join(train_groups)}), so the lanes take turns and staleness {options.staleness} only makes "
                f"the batches older; {fix}")
    elif other:
        note = (f"the rollout lane also works on rank(s) {', '.join(map(str, other))} of the train lane "
                f"({', '.join(name for name in rollout_groups if ranks([name]) & training)}): there it waits for the update")
    else:
        note = ""
    return Overlap(options.staleness, options.staleness_policy, role, rollout, train, split, rollout_groups, train_groups,
                   not shared, note)


def _even_split(options: CompileOptions, train_groups: tuple[str, ...]) -> str:
    """The mesh halved between the trainer and a `rollout` generator (one rank each on 2 ranks)."""
    size = options.mesh.size
    trainer = train_groups[0] if train_groups else "policy"
    return f"{{{trainer!r}: {max(size // 2, 1)}, 'rollout': {max(size - size // 2, 1)}}}"


def _notes(options: CompileOptions) -> tuple[str, ...]:
    resident = (("vllm on cpu: no sleep mode; the engine keeps its weights and KV cache in host memory beside the "
                 "trainer, and a sync_weights step reloads them in place",)
                if options.generation_engine == "vllm" and options.mesh.device == "cpu" else ())
    return resident + _offload_notes(options)


def _offload_notes(options: CompileOptions) -> tuple[str, ...]:
    offload = isinstance(options.placement, Colocated) and options.placement.offload
    if not getattr(options.placement, "cpu_offload", False):
        return ("offload/onload: optimizer state and gradients leave the device while the colocated generator runs",
                ) if offload else ()
    if options.mesh.device == "cpu":
        return ("cpu_offload: on a cpu mesh the training state is in host memory already; the device figures keep it",)
    return ("cpu_offload: parameters, gradients and optimizer state stay in host memory; each FSDP2 unit's shards are "
            "copied to the device for its all-gather, its gradients back, and the optimizer step runs on the CPU",)


def _offload_points(stage: list[fx.Node], index: int, memory: dict, offloaded: set[str],
                    engine: str = "native") -> list[Offload]:
    """Offload right before a stage that runs `generate` on a group that also trains, onload right
    before the stage that runs its next `update`: a stage that only reads fields moves nothing."""
    points = []
    for node in stage:
        prim, role = primitive_name(node), node.meta["role"]
        phases = memory.get(role, {})
        if "train" not in phases or "generate" not in phases:
            continue
        if (prim in GENERATORS and role not in offloaded) or (prim == "update" and role in offloaded):
            parked = sum(phases["train"].get(part, 0) for part in PARKED)
            # Under cpu_offload nothing of the trainer is on the device; the step stays, as the generator's turn.
            what = "optimizer+grads" if parked else "nothing (cpu_offload: optimizer+grads stay in host memory)"
            direction = "onload" if role in offloaded else "offload"
            # what the step does to a vLLM engine (`check_sleep_mode`: only where it can sleep)
            action = "" if engine != "vllm" else "vllm sleeps (weights+kv_cache)" if direction == "onload" else "vllm wakes kv_cache"
            points.append(Offload(index + len(points), role, what, direction, parked, action))
            (offloaded.add if direction == "offload" else offloaded.discard)(role)  # the caller's set, across stages
    return points


def _placement_text(options: CompileOptions) -> str:
    placement = options.placement
    cpu_offload = ", cpu_offload=True" if getattr(placement, "cpu_offload", False) else ""
    if isinstance(placement, Colocated):
        return f"colocated(fsdp={placement.fsdp or options.mesh.size}, tp={placement.tp}, offload={placement.offload}{cpu_offload})"
    name = type(placement).__name__.lower()
    groups = getattr(placement, "groups", {})
    if isinstance(groups, dict):
        return f"{name}({groups}{cpu_offload})"
    return f"{name}({', '.join(group.name for group in groups)})"
