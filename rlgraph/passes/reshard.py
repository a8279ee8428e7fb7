"""`reshard`: make every move of data explicit.

For every edge whose producer and consumer live in different layouts, insert one `transfer`
node (a collective) and rewire the consumer to it; for every `generate`, insert `sync_weights`
moving the model version it consumes from the training layout to the generation layout.

Layouts: a value on the controller; a per-rollout value on a group, split across its data-parallel
ranks; a scalar on a group, replicated. Collective kinds:
- controller -> group: `scatter` (per-rollout values) or `broadcast` (scalars);
- group -> controller: `gather`;
- group -> another group on the same ranks, other split: `all_to_all`; on other ranks: `send_recv`.
A field read of a record that is moved anyway is re-read at the destination instead of moved twice
(and the source's read, left without users, is dropped: it would be work the plan shows for nothing).

Guarantees: after this pass, every edge joins equal layouts or passes through exactly one
transfer node, and a transfer's `bytes` is the size of the value it moves (a VLM's `Prompts` and
`Rollouts` rows with their images, at the pixel budget).
"""

from __future__ import annotations

import torch.fx as fx

from rlgraph.ir import specs as S
from rlgraph.ir.primitives import GENERATORS, primitive_name
from rlgraph.ir.program import Program, copy_program
from rlgraph.ir.infer import get_field
from rlgraph.passes.memory_plan import pixel_bytes_per_row
from rlgraph.passes.options import CompileOptions
from rlgraph.plan.layouts import CONTROLLER
from rlgraph.passes.partition import value_bytes
from rlgraph.plan.layouts import collective_kind  # the rule is the plan's, shared with the runtime
from rlgraph.plan.mesh import Group


def transfer(value, *, kind, src, dst, nbytes):
    """Target of collective nodes. In one process the value is already where it is needed."""
    return value


def sync_weights(model, *, src, dst, nbytes, buckets):
    """Target of weight-sync nodes; executors that keep separate engines implement the copy."""
    return model


def is_per_row(spec: S.Spec) -> bool:
    return isinstance(spec, S.RecordSpec) or (isinstance(spec, S.TensorSpec) and spec.shape[:1] in ((S.N,), (S.B,)))


def layout_of(node: fx.Node, groups: dict[str, Group], value: fx.Node | None = None) -> tuple:
    """Where `value` (default: the node's own result) must be for `node` to run: the controller,
    or the node's group ranks split `dp` ways (per-row values) or replicated (split 1)."""
    role = node.meta["role"]
    if role == CONTROLLER:
        return (CONTROLLER,)
    group = groups[role]
    split = group.generate.dp if node.meta.get("phase") == "generate" and group.generate else group.dp
    return (group.ranks, split if is_per_row((value or node).meta["spec"]) else 1)


def _movable(node: fx.Node) -> bool:
    return not isinstance(node.meta.get("spec"), (S.ModelSpec, S.RewardSpec, S.EnvSpec, S.StatsSpec))


def reshard(program: Program, options: CompileOptions) -> Program:
    out, _ = copy_program(program)
    groups = {group.name: group for group in out.annotations["groups"]}
    sizes, pixel_row = options.concrete(program.hparams.get("n")), pixel_bytes_per_row(options)

    def measure(spec: S.Spec) -> int:  # a value's bytes; a batch record's rows carry their images too
        images = pixel_row * S.f32(spec.rows).numel(sizes) if _carries_images(spec) else 0  # rows x bytes a row
        return value_bytes(spec, sizes) + images

    moved: dict[tuple[fx.Node, tuple], fx.Node] = {}
    for node in list(out.graph.nodes):
        if node.op in ("placeholder", "output"):
            continue
        if primitive_name(node) in GENERATORS:
            _insert_sync(out, node, groups, options)
        for arg in list(node.all_input_nodes):
            consumer_layout = layout_of(node, groups, arg)
            if not _movable(arg) or layout_of(arg, groups) == consumer_layout:
                continue
            key = (arg, consumer_layout)
            if key not in moved:
                moved[key] = _bring(out, arg, node, consumer_layout, groups, measure, moved)
            node.replace_input_with(arg, moved[key])
    _gather_outputs(out, groups, measure, moved)
    for node in list(out.graph.nodes):  # a read whose record moved and was re-read at the destination
        if node.target is get_field and not node.users:
            out.graph.erase_node(node)
    return out.verify(after="reshard")


def _carries_images(spec: S.Spec) -> bool:
    """`Prompts` and `Rollouts` rows hold their prompt's images (`pixel_values`, `image_grid_thw`)."""
    return isinstance(spec, S.RecordSpec) and spec.kind in ("Prompts", "Rollouts")


def _gather_outputs(program: Program, groups: dict[str, Group], measure, moved) -> None:
    """The algorithm's `outputs` are handed to the caller on the controller, whole: each one that
    lives on a worker group gets a gather the plan shows (every data-parallel rank's rows, not the
    first rank's)."""
    output = program.output
    if not output.kwargs.get("outputs"):
        return
    output.meta.update(role=CONTROLLER, phase="controller")  # what `_bring` reads of the consumer
    gathered = {}
    for key, value in output.kwargs["outputs"].items():
        if _movable(value) and layout_of(value, groups) != (CONTROLLER,):
            key_moved = (value, (CONTROLLER,))
            if key_moved not in moved:
                moved[key_moved] = _bring(program, value, output, (CONTROLLER,), groups, measure, moved)
            value = moved[key_moved]
        gathered[key] = value
    output.kwargs = {**output.kwargs, "outputs": gathered}


def _bring(program: Program, value: fx.Node, consumer: fx.Node, layout: tuple, groups, measure, moved) -> fx.Node:
    """A node holding `value` in `layout`: a local field read of a moved record, or a transfer."""
    graph = program.graph
    if value.target is get_field and (value.args[0], layout) in moved:
        record_here = moved[(value.args[0], layout)]
        with graph.inserting_after(record_here):
            local = graph.create_node("call_function", get_field, (record_here, value.args[1]), {}, name=value.name)
        local.meta.update(value.meta, role=consumer.meta["role"], phase=consumer.meta["phase"])
        return local
    src = layout_of(value, groups)
    spec = value.meta["spec"]
    kind = collective_kind(src, layout, is_per_row(spec))
    with graph.inserting_before(consumer):
        node = graph.create_node(
            "call_function", transfer, (value,),
            {"kind": kind, "src": value.meta["role"], "dst": consumer.meta["role"], "nbytes": measure(spec)},
            name=f"{kind}_{value.name}",
        )
    node.meta.update(spec=spec, role=consumer.meta["role"], phase="transfer", transfer=True, source=value.meta.get("source"),
                     layouts=(src, layout), per_row=is_per_row(spec))  # what the runtime's transports move
    return node


def _sync_bytes(options: CompileOptions, role: str, gen_group: Group) -> int:
    """What a sync of `role` moves: its weights, or, for a LoRA role generating on vLLM on a cpu mesh,
    its adapters alone. There the local runtime's engine holds the frozen base and loads adapters
    through vLLM's LoRA support (`VLLMLocalExecutor`); the FSDP2 executor (spmd/Ray, the GPU path)
    merges the adapters into full weights for its engine, so on GPUs the step moves those."""
    from rlgraph.passes.memory_plan import model_shape, param_bytes, param_dtype

    shape, lora = model_shape(options, role), options.lora.get(role)
    vllm = gen_group.generate is not None and gen_group.generate.engine == "vllm"
    if lora is not None and vllm and options.mesh.device == "cpu":
        return shape.lora_params(lora) * param_dtype(options.mesh).itemsize
    return param_bytes(shape, options.mesh)


def _insert_sync(program: Program, generate: fx.Node, groups: dict[str, Group], options: CompileOptions) -> None:

    model = generate.args[0]
    role = model.meta["spec"].role
    gen_group = groups[generate.meta["role"]]
    train_group = groups.get(role)
    if train_group is None or train_group.train is None:
        return  # a frozen generator already holds its weights
    nbytes = _sync_bytes(options, role, gen_group)
    buckets = max(1, -(-nbytes // options.bucket_bytes))
    src = f"{role}[{train_group.train}]"
    dst = f"{gen_group.name}[{gen_group.generate}]"
    with program.graph.inserting_before(generate):
        node = program.graph.create_node(
            "call_function", sync_weights, (model,), {"src": src, "dst": dst, "nbytes": nbytes, "buckets": buckets},
            name=f"sync_{role}",
        )
    node.meta.update(spec=model.meta["spec"], role=gen_group.name, phase="sync", sync=True, source=generate.meta.get("source"),
                     ranks=(train_group.ranks, gen_group.ranks))  # trained on -> generated on
    generate.replace_input_with(model, node)
