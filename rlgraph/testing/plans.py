"""Checkers for compiled plans: structural invariants, reshard round trips, compiled == eager.

    rgt.assert_plan_invariants(compiled)                 # any compiled algorithm, any placement
    rgt.assert_reshard_round_trip(((0, 1, 2, 3), 4), ((4, 5, 6, 7), 2), value)
    rgt.assert_compiled_matches_eager(grpo, executor=rgt.tiny_executor, batches=[rgt.tiny_prompts(4)], n=4)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
from hypothesis import given, settings as Settings, strategies as st

from rlgraph.batches import Prompts, Rollouts
from rlgraph.ir import specs as S
from rlgraph.passes.partition import value_bytes
from rlgraph.plan.compiled import Compiled
from rlgraph.passes.reshard import is_per_row, layout_of, transfer
from rlgraph.plan.plan import Stage
from rlgraph.runtime import collectives as C
from rlgraph.testing.counterexample import fail

_PLAN = "plan invariants"


# -- plan invariants --------------------------------------------------------------------------------


def step_of_each_node(compiled: Compiled) -> dict[str, int]:
    """Program node name -> index of the plan step that runs it."""
    position: dict[str, int] = {}
    for node in compiled.program.graph.nodes:
        if "step" in node.meta:
            position[node.name] = node.meta["step"]
    for step in compiled.plan.steps:
        if isinstance(step, Stage):
            for name in step.nodes:
                if name in position:
                    fail(_PLAN, compiled.plan.algorithm, f"node {name} is run by two steps: {position[name]} and {step.index}")
                position[name] = step.index
    return position


def assert_plan_invariants(compiled: Compiled) -> None:
    """What every plan must satisfy, whatever the algorithm, mesh and placement:

    1. steps are numbered in order and every program node is run by exactly one step;
    2. acyclic: no step runs before a step that produces one of its inputs;
    3. every edge between two layouts passes through exactly one collective (none is useless,
       none is chained), and its kind is the one the two layouts call for;
    4. bytes add up: a transfer moves exactly the bytes of its value at the plan's sizes, and the
       collective, simulated over per-rank shards, delivers the value whole and back again;
    5. a refill loop (`rg.filter_groups`) re-runs exactly the steps of its region, all before the
       filter's step, and no step outside the loop reads a value made inside it except the filter;
    6. with `staleness` >= 1, every step is in exactly one lane, no rollout step reads a value a
       train step made (batch i+k's rollout lane never waits for batch i's update), a generate
       stage is in the rollout lane, the issue order runs every step once, and the lanes are called
       overlapped exactly when generation runs on no rank of the train lane.
    """
    plan, program = compiled.plan, compiled.program
    name = plan.algorithm
    if [step.index for step in plan.steps] != list(range(len(plan.steps))):
        fail(_PLAN, name, "steps are not numbered 0..k in order", steps=[step.index for step in plan.steps])
    position = step_of_each_node(compiled)
    calls = [node for node in program.graph.nodes if node.op not in ("placeholder", "output")]
    missing = [node.name for node in calls if node.name not in position]
    if missing:
        fail(_PLAN, name, f"node(s) {', '.join(missing)} are run by no step of the plan", missing=missing)
    for node in calls:
        for arg in node.all_input_nodes:
            if arg.name in position and position[arg.name] > position[node.name]:
                fail(_PLAN, name, f"step {position[node.name]} runs {node.name} before step {position[arg.name]} "
                      f"produces its input {arg.name}", node=node.name, input=arg.name)
    _check_collectives(compiled)
    _check_loops(compiled, position)
    if plan.overlap is not None:
        _check_overlap(compiled, position)


def _check_overlap(compiled: Compiled, position: dict[str, int]) -> None:
    plan, overlap, name = compiled.plan, compiled.plan.overlap, compiled.plan.algorithm
    if sorted((*overlap.rollout, *overlap.train)) != list(range(len(plan.steps))):
        fail(_PLAN, name, "the lanes do not split the steps: each step must be in exactly one",
             rollout=overlap.rollout, train=overlap.train)
    if sorted(index for _, index in overlap.order) != list(range(len(plan.steps))):
        fail(_PLAN, name, "the issue order does not run every step exactly once", order=overlap.order)
    train = set(overlap.train)
    for node in compiled.program.graph.nodes:
        if node.name in position and position[node.name] not in train:
            made = [arg.name for arg in node.all_input_nodes if position.get(arg.name) in train]
            if made:
                fail(_PLAN, name, f"rollout step {position[node.name]} reads {made[0]}, made by train step "
                     f"{position[made[0]]}: batch i+k would wait for batch i's update", node=node.name)
    if not any(getattr(plan.steps[i], "phase", "") == "generate" for i in overlap.rollout):
        fail(_PLAN, name, "no generate stage in the rollout lane: nothing runs ahead of the update")
    groups = {group.name: set(group.ranks) for group in plan.groups}
    generating = {rank for i in overlap.rollout if getattr(plan.steps[i], "phase", "") == "generate"
                  for rank in groups[plan.steps[i].group]}
    trained = set().union(*(groups[g] for g in overlap.train_groups)) if overlap.train_groups else set()
    if overlap.overlapped != (not generating & trained):
        fail(_PLAN, name, f"overlapped={overlap.overlapped}, but generation runs on ranks {sorted(generating)} and "
             f"training on {sorted(trained)}")


def _check_loops(compiled: Compiled, position: dict[str, int]) -> None:
    plan, program = compiled.plan, compiled.program
    regions = {loop.filter: loop for loop in program.annotations.get("loops", ())}
    if len(regions) != len(plan.loops):
        fail(_PLAN, plan.algorithm, f"the program has {len(regions)} refill loop(s), the plan {len(plan.loops)}")
    nodes = {node.name: node for node in program.graph.nodes}
    for loop in plan.loops:
        region = next((r for r in regions.values() if position.get(r.filter) == loop.filter_step), None)
        if region is None:
            fail(_PLAN, plan.algorithm, f"loop over steps {loop.steps}: no filter_groups node runs at step {loop.filter_step}")
        wanted = tuple(sorted({position[name] for name in region.nodes if name in position}))
        if tuple(loop.steps) != wanted:
            fail(_PLAN, plan.algorithm, f"loop re-runs steps {list(loop.steps)}, but its region {list(region.nodes)} "
                  f"runs at steps {list(wanted)}")
        if loop.steps and max(loop.steps) >= loop.filter_step:
            fail(_PLAN, plan.algorithm, f"loop step {max(loop.steps)} is not before its filter at step {loop.filter_step}")
        inside = set(region.nodes)
        for name in region.nodes:
            for user in nodes[name].users:
                if user.name not in inside and user.name != region.filter and user.users:
                    fail(_PLAN, plan.algorithm, f"{user.name} (step {position.get(user.name)}) reads {name} from inside "
                          f"the refill loop of {region.filter}: it would see only the first round")


def _movable(node) -> bool:
    return not isinstance(node.meta.get("spec"), (S.ModelSpec, S.RewardSpec, S.EnvSpec, S.StatsSpec))


def _check_collectives(compiled: Compiled) -> None:
    program, name = compiled.program, compiled.plan.algorithm
    groups = {group.name: group for group in program.annotations["groups"]}
    sizes = compiled.options.concrete(program.hparams.get("n"))
    steps = {step.index: step for step in compiled.plan.steps}
    for node in program.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.target is transfer:
            source = node.args[0]
            src, dst = layout_of(source, groups), layout_of(node, groups, source)
            if source.target is transfer:
                fail(_PLAN, name, f"{node.name}: two collectives in a row on one edge", transfer=node.name)
            if src == dst:
                fail(_PLAN, name, f"{node.name} moves {source.name} to the layout it is already in: {src}", transfer=node.name)
            kind = node.kwargs["kind"]
            wanted = C.expected_kind(src, dst, is_per_row(source.meta["spec"]))
            if kind != wanted:
                fail(_PLAN, name, f"{node.name} is a {kind}, but moving {source.name} from {src} to {dst} is a {wanted}")
            nbytes = value_bytes(source.meta["spec"], sizes)
            step = steps[node.meta["step"]]
            if step.bytes != nbytes:
                fail(_PLAN, name, f"step {step.index} says {step.bytes} bytes, but {source.name}:{source.meta['spec']} "
                      f"is {nbytes} bytes at {sizes}", step=step.text())
            _round_trip_or_fail(src, dst, stand_in(source.meta["spec"]), kind, f"{node.name} ({step.text()})", name)
            continue
        for arg in node.all_input_nodes:
            if not _movable(arg) or arg.target is transfer:
                continue
            if layout_of(arg, groups) != layout_of(node, groups, arg):
                fail(_PLAN, name, f"{arg.name} -> {node.name} crosses from {layout_of(arg, groups)} to "
                      f"{layout_of(node, groups, arg)} without a collective", edge=(arg.name, node.name))


def stand_in(spec: S.Spec, rows: int = 7, length: int = 3) -> Any:
    """A small value of `spec` (N = B = `rows`, every other dim `length`) with distinct entries."""
    if isinstance(spec, S.RecordSpec):
        if spec.kind == "Prompts":
            ids = torch.arange(rows * length).reshape(rows, length)
            return Prompts(ids, torch.ones(rows, length, dtype=torch.bool))
        ids = torch.arange(rows * length).reshape(rows, length)
        return Rollouts(ids, torch.ones(rows, length, dtype=torch.bool), ids + 1, ids % 2 == 0,
                        ids.float() / 10, torch.arange(rows))
    shape = [rows if size in (S.N, S.B) else length for size in spec.shape]
    count = 1
    for size in shape:
        count *= size
    return torch.arange(count).reshape(shape).to(spec.dtype)


def _round_trip_or_fail(src: tuple, dst: tuple, value: Any, kind: str, what: str, name: str) -> None:
    problem = reshard_problem(src, dst, value, kind)
    if problem:
        fail(_PLAN, name, f"{what}: {problem}", src=src, dst=dst)


def reshard_problem(src: tuple, dst: tuple, value: Any, kind: str | None = None, per_row: bool | None = None) -> str | None:
    """None if moving `value` from `src` to `dst` (and back) delivers exactly the right shards."""
    rows_of = C._rows(value)
    per_row = rows_of is not None if per_row is None else per_row
    kind = kind or C.expected_kind(src, dst, per_row)
    try:
        there, sent = C.move(C.shard(value, src), src, dst, kind, per_row=per_row)
        back, _ = C.move(there, dst, src, C.expected_kind(dst, src, per_row), per_row=per_row)
    except C.CollectiveError as exc:
        return str(exc)
    want_there = C.shard(value, dst)
    for rank, piece in want_there.items():
        if not C._same(piece, there.get(rank)):
            return f"after the {kind}, {rank} does not hold its shard of the value"
    if not C._same(C.unshard(back, src), value):
        return f"{kind} there and back does not give the value back"
    if sent > C._nbytes(value):
        return f"the {kind} sends {sent} bytes, more than the whole value ({C._nbytes(value)})"
    return None


# -- reshard round trip -----------------------------------------------------------------------------


def assert_reshard_round_trip(src: tuple | None = None, dst: tuple | None = None, value: Any = None, *,
                              mesh_size: int = 8, settings: Settings | None = None) -> None:
    """Moving a value between two layouts with the collective the compiler would pick, and back,
    gives every rank exactly its shard and the value back whole.

    With `src`, `dst` and `value` given, checks that one case; otherwise runs hypothesis over
    layouts on `mesh_size` ranks and per-row values with ragged row counts.
    """
    if src is not None and dst is not None and value is not None:
        problem = reshard_problem(src, dst, value)
        if problem:
            fail("reshard round trip", "reshard", problem, src=src, dst=dst, value=value)
        return
    from rlgraph.testing.checks import run_property
    from rlgraph.testing.strategies import layouts

    @given(layouts(mesh_size), layouts(mesh_size), st.integers(0, 12), st.integers(1, 3))
    def prop(a: tuple, b: tuple, rows: int, cols: int) -> None:
        if a == b:
            return
        value = torch.arange(rows * cols).reshape(rows, cols)
        problem = reshard_problem(a, b, value)
        if problem:
            fail("reshard round trip", "reshard", problem, src=a, dst=b, value=value.tolist())

    run_property(prop, settings)


# -- compiled == eager ------------------------------------------------------------------------------


def _parameters(executor: Any) -> dict[str, list[torch.Tensor]]:
    models = getattr(executor, "models", {})
    return {role: [p.detach().clone() for p in worker.model.parameters()] for role, worker in models.items()}


def _run_steps(runner: Any, batches: Sequence[Any], more_prompts: Sequence[Prompts] | None) -> list[dict[str, float]]:
    refills = iter(more_prompts or ())
    source = (lambda: next(refills)) if more_prompts is not None else None
    return [runner.run(batch, more_prompts=source)[1] for batch in batches]


def _compare_runs(prop: str, what: str, labels: tuple[str, str], runs: list, rtol: float, atol: float,
                  skip: Callable[[str], bool] = lambda key: False, **context: Any) -> None:
    """Fail unless two runs' metrics (every step) and final parameters agree to rtol/atol."""
    (a_metrics, a_params), (b_metrics, b_params) = runs
    for step, (a, b) in enumerate(zip(a_metrics, b_metrics)):
        if a.keys() != b.keys():
            fail(prop, what, f"step {step}: metrics {sorted(b)} ({labels[1]}) != {sorted(a)} ({labels[0]})")
        for key in a:
            if key.startswith("time/") or skip(key):
                continue
            if not torch.isclose(torch.tensor(b[key], dtype=torch.float64), torch.tensor(a[key], dtype=torch.float64),
                                 rtol=rtol, atol=atol, equal_nan=True):
                fail(prop, what, f"step {step}: {key} = {b[key]!r} {labels[1]}, {a[key]!r} {labels[0]}",
                      step=step, metric=key, **context)
    for role in a_params:
        for index, (x, y) in enumerate(zip(a_params[role], b_params[role])):
            if not torch.allclose(x, y, rtol=rtol, atol=atol):
                fail(prop, what, f"{role} parameter {index} differs by up to {float((x - y).abs().max()):.3g} "
                      f"({labels[1]} against {labels[0]}) after {len(a_metrics)} step(s)", role=role, **context)


def _default_sizes(batches: Sequence[Any], hparams: Mapping[str, Any]) -> dict[str, int]:
    first = batches[0]
    return {"B": len(first), "P": first.ids.shape[1] if isinstance(first, Prompts) else 8,
            "T": hparams.get("max_new_tokens") or 8}


def assert_compiled_matches_eager(algorithm: Any, *, executor: Callable[[], Any], batches: Sequence[Any],
                                  mesh: str = "cpu:1", placement: Any = None, sizes: Mapping[str, int] | None = None,
                                  roles: Mapping[str, S.Spec] | None = None, rtol: float = 1e-5, atol: float = 1e-6,
                                  more_prompts: Sequence[Prompts] | None = None, **hparams: Any) -> list[dict[str, float]]:
    """Running the compiled plan gives the eager interpreter's numbers, step for step.

    `executor()` must build identical fresh executors (same seeds); each run gets its own. The
    metrics of every step must agree to `rtol`/`atol` (fused kernels differ from plain ops by
    float rounding only), and so must every parameter of every model afterwards. `more_prompts`
    feeds `rg.filter_groups` refills (each run draws from its own copy of the list, in order).
    Returns the compiled run's metrics.
    """
    import rlgraph as rg
    from rlgraph.runtime.plan_runner import PlanRunner
    from rlgraph.runtime.runner import EagerRunner

    compiled = rg.compile(algorithm, mesh=mesh, placement=placement or rg.colocated(offload=False, checkpointing=False),
                          sizes=dict(sizes or _default_sizes(batches, hparams)), roles=roles, **hparams)
    runs = []
    for runner in ("eager", "compiled"):
        ex = executor()
        stepper = EagerRunner(compiled.source, ex) if runner == "eager" else PlanRunner(compiled, ex)
        runs.append((_run_steps(stepper, batches, more_prompts), _parameters(ex)))
    _compare_runs("compiled == eager", getattr(algorithm, "name", repr(algorithm)), ("eager", "compiled"), runs,
                  rtol, atol, plan=compiled.as_text())
    return runs[1][0]


def assert_update_microbatch_invariant(algorithm: Any, *, executor: Callable[[], Any], batches: Sequence[Any],
                                       micro_batch_sizes: Sequence[int] = (1, 2), roles: Mapping[str, S.Spec] | None = None,
                                       rtol: float = 1e-4, atol: float = 1e-6, more_prompts: Sequence[Prompts] | None = None,
                                       **hparams: Any) -> None:
    """An algorithm's training steps do not depend on its `micro_batch_size`, end to end.

    The algorithm runs `len(batches)` steps without micro-batching, then again with each size in
    `micro_batch_sizes` (fresh identical executors: use SGD, as `tiny_executor` does, so a step is
    the gradient itself). Every metric of every step, and every parameter afterwards, must agree. This is the property `assert_microbatch_invariant` states for one loss,
    checked through the executor's real micro-batch loop, the global counts it sets, the kernels and
    gradient clipping. The algorithm must take a `micro_batch_size` hyper-parameter.

    A run whose updates move no parameter of a role they update (every advantage 0: each group's
    rewards tie, as they often do with 2 prompts of an untrained model) would agree for any split,
    so it is refused with a `ConfigError`, not passed. A failure's snippet is the call that repeats it.
    """
    from rlgraph.runtime.runner import EagerRunner
    from rlgraph.testing.counterexample import PropertyFailure

    what = getattr(algorithm, "name", repr(algorithm))

    def run(size: int | None) -> tuple:
        ex = executor()
        program = algorithm.trace(roles=roles, micro_batch_size=size, **hparams)
        before = _parameters(ex)
        metrics = _run_steps(EagerRunner(program, ex), batches, more_prompts)
        return (metrics, _parameters(ex)), before, program

    whole, before, program = run(None)
    _refuse_vacuous(what, program, before, whole[1], len(batches))
    for size in micro_batch_sizes:
        try:
            _compare_runs("update micro-batch invariance", what, ("whole batch", f"micro_batch_size={size}"),
                          [whole, run(size)[0]], rtol, atol, micro_batch_size=size)
        except PropertyFailure as failure:
            call = _repeat_call(algorithm, executor, batches, size, roles, rtol, atol, more_prompts, hparams)
            raise PropertyFailure(attrs.evolve(failure.counterexample, source=call)) from None


def _refuse_vacuous(what: str, program: Any, before: dict, after: dict, steps: int) -> None:
    """A ConfigError when a role the program updates kept every parameter: nothing to compare."""
    from rlgraph.errors import ConfigError

    updated = sorted({program.spec(node.args[0]).role for node in program.primitive_nodes("update")})
    still = [role for role in updated if role in before
             and all(torch.equal(x, y) for x, y in zip(before[role], after[role]))]
    if still:
        raise ConfigError(
            f"assert_update_microbatch_invariant({what}): {steps} step(s) without micro-batching left every parameter "
            f"of {', '.join(still)} unchanged (all advantages 0? each group's rewards tie), so any micro-batch size "
            "would agree and the check would pass without testing anything",
            fix="pass batches whose groups' rewards differ: more prompts (rgt.tiny_prompts(4)) or more samples (n=4)")


def _repeat_call(algorithm: Any, executor: Callable, batches: Sequence[Any], size: int, roles: Any, rtol: float,
                 atol: float, more_prompts: Sequence[Prompts] | None, hparams: Mapping[str, Any]) -> str:
    """Python that repeats the failing comparison: the same algorithm, executor, batches and size."""
    lines = ["import rlgraph.testing as rgt", "from rlgraph.batches import Prompts", "",
             _named("algorithm", getattr(algorithm, "fn", algorithm), wrapped=hasattr(algorithm, "fn")),
             _named("executor", executor),
             f"batches = [{', '.join(_prompts_source(b) for b in batches)}]"]
    extra = {**hparams, "rtol": rtol, "atol": atol}
    if more_prompts is not None:
        lines.append(f"more_prompts = [{', '.join(_prompts_source(b) for b in more_prompts)}]")
    if roles is not None:
        lines.append(f"roles = {roles!r}  # as passed")
    args = "".join(f", {key}={value!r}" for key, value in extra.items())
    args += ", more_prompts=more_prompts" if more_prompts is not None else ""
    args += ", roles=roles" if roles is not None else ""
    lines.append(f"rgt.assert_update_microbatch_invariant(algorithm, executor=executor, batches=batches, "
                 f"micro_batch_sizes=[{size}]{args})")
    return "\n".join(lines)


def _named(name: str, obj: Any, wrapped: bool = False) -> str:
    """`name = <obj>` as an import when `obj` is a module-level name, as the lambda's own source when it
    is a lambda, else a line that says what to put there."""
    import importlib

    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", "")
    if module and qualname.isidentifier():
        try:
            found = getattr(importlib.import_module(module), qualname)
            if getattr(found, "fn", found) is obj:  # an @rg.algorithm is imported whole
                return f"from {module} import {qualname} as {name}"
        except (ImportError, AttributeError):
            pass
    if getattr(obj, "__name__", "") == "<lambda>" and (text := _lambda_source(obj)):
        return f"{name} = {text}"
    what = "the algorithm" if wrapped else "the executor factory"
    return f"{name} = None  # replace with {what} your test passed ({qualname or obj!r}: not importable by name)"


def _lambda_source(fn: Callable) -> str | None:
    """The source text of a lambda (the first lambda on its line), or None when it cannot be read."""
    import ast
    import inspect

    try:
        lines, first = inspect.getsourcelines(fn)
    except (OSError, TypeError):
        return None
    text = "".join(lines)
    try:
        tree = ast.parse(text.strip() if not text.startswith((" ", "\t")) else "if 1:\n" + text)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Lambda):
            return ast.unparse(node)
    return None


def _prompts_source(prompts: Prompts) -> str:
    meta = f", meta={dict(prompts.meta)!r}" if prompts.meta else ""
    return (f"Prompts(torch.tensor({prompts.ids.tolist()!r}), torch.tensor({prompts.mask.tolist()!r}){meta}, "
            f"index=torch.tensor({prompts.index.tolist()!r}))")
