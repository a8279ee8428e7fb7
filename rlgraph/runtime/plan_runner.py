"""Execute a compiled plan, step by step, over a transport.

The runner is the single controller: it walks `plan.steps` and runs exactly the program nodes
each step names, where the step says.
- A stage on the controller runs its nodes here (math, `score` with a reward function, the
  `filter_groups` rule with its refill loop).
- A stage on a worker group runs on every rank of the group, each on the piece of the data it
  holds under the step's layout (`transport.run`).
- A transfer runs its collective: controller -> group is a scatter or broadcast, group ->
  controller a gather, group -> group an all_to_all or send_recv (`transport.move`).
- A `sync_weights` step loads the trained weights into the generation engines; an offload or
  onload step parks optimizer state and gradients off the device around generation.

The transport decides only how ranks are reached: `LocalTransport` (every rank in this process),
`SpmdTransport` (one process per rank, torch.distributed). The same plan runs on both, with the
same results (tests/runtime/test_spmd.py). The runner keeps the Interpreter's interface, so the
Trainer runs a compiled plan exactly as it runs the eager interpreter.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping, Sized
from typing import Any

import torch.fx as fx

from rlgraph.backends.protocols import Executor, ModelRef
from rlgraph.ir import specs as S
from rlgraph.ir.errors import RLGraphError
from rlgraph.ir.primitives import primitive_name
from rlgraph.plan.compiled import Compiled
from rlgraph.plan.layouts import CONTROLLER
from rlgraph.plan.plan import Loop, Offload, Stage, SyncWeights, Transfer
from rlgraph.runtime.eager import Interpreter, flatten_metrics, run_node
# The errors are re-exported here, where callers have always imported them from.
from rlgraph.runtime.errors import PlanInputError, PlanStepError, WorkerFailure
from rlgraph.runtime.refill import MorePrompts, require_prompt_source, run_filter
from rlgraph.runtime.transport import LocalTransport, SyncRoute, Transport

__all__ = ["PlanRunner", "PlanInputError", "PlanStepError", "WorkerFailure"]


class PlanRunner(Interpreter):
    """Runs `compiled` over `transport` (or over an executor, in this process).

    A transport is a `Transport` subclass (every command declared, so none is probed for); any
    other object is an executor, run through a `LocalTransport`. `controller` runs the controller's
    primitives (`score` with a reward function); it defaults to the local transport's executor.
    """

    def __init__(self, compiled: Compiled, transport: Transport | Executor, controller: Executor | None = None):
        if not isinstance(transport, Transport):
            transport = LocalTransport(transport)
        controller = controller or transport.executor
        if controller is None:
            raise RLGraphError("PlanRunner over remote workers needs the controller's executor (it scores with the "
                               "reward functions); pass controller=world.controller()")
        super().__init__(controller)
        self.compiled = compiled
        self.transport = transport
        self.nodes = {node.name: node for node in compiled.program.graph.nodes}
        self.groups = {group.name: group for group in compiled.plan.groups}
        self.versions: dict[str, int] = {}
        self.bytes_moved = 0
        self.step_seconds: dict[int, float] = {}  # plan step index -> seconds spent in it, summed over runs
        self._key = f"{compiled.program.name}-{id(compiled)}"
        transport.load(self._key, compiled.program)

    def run(self, program: Any, batch: Any = None, *, more_prompts: MorePrompts | None = None
            ) -> tuple[dict[str, Any], dict[str, float]]:
        """`run(batch)`, or `run(program, batch)` for the Trainer's interface (the program is the compiled one)."""
        batch = program if batch is None else batch
        lowered, plan = self.compiled.program, self.compiled.plan
        self._check_divides(batch)
        require_prompt_source(lowered.annotations.get("loops", ()), lowered, more_prompts)
        env = self._bind(lowered, batch)
        loop_at = {loop.filter_step: loop for loop in plan.loops}
        for step in plan.steps:
            start = time.perf_counter()
            self.transport.at_step(step)
            with self._context(step):
                if step.index in loop_at:
                    self._run_filter_step(step, loop_at[step.index], env, more_prompts)
                else:
                    self._run_step(step, env)
            self.step_seconds[step.index] = self.step_seconds.get(step.index, 0.0) + time.perf_counter() - start
        with self._context(plan.steps[-1]):
            state, metrics = fx.node.map_arg(lowered.output.args[0], functools.partial(self._value, env))
            self.transport.flush()  # every command of this iteration has finished
        self.versions.update({ref.role: ref.version for ref in state.values() if isinstance(ref, ModelRef)})
        self.remember(state)
        return state, flatten_metrics(metrics)

    def _check_divides(self, batch: Any) -> None:
        """Every data-parallel rank gets the same number of whole prompts (and so of groups and
        micro-batches: ranks that disagree on the number of FSDP2 collectives would wait forever)."""
        rows = len(batch) if isinstance(batch, Sized) else None
        for group in self.compiled.plan.groups:
            ways = max(group.dp, group.generate.dp if group.generate else 1)
            if rows is not None and ways > 1 and rows % ways:
                raise PlanInputError(
                    f"the batch has {rows} rows, which group {group.name!r} cannot split evenly over its {ways} "
                    f"data-parallel ranks ({group.ranks_text()}); use a batch size divisible by {ways}")

    # -- checkpoints ---------------------------------------------------------------------------
    def export_state(self) -> Any:
        """The roles' full weights and optimizer states and the random streams, wherever they live."""
        return self.transport.checkpoint_state()

    def import_state(self, state: Any, where: str = "the checkpoint") -> None:
        self.transport.restore_state(state, where)
        self.versions.clear()  # asked again of the ranks

    # -- inputs and outputs --------------------------------------------------------------------
    def _bind(self, lowered: Any, batch: Any) -> dict[fx.Node, Any]:
        """The controller's inputs, and each rank's model versions sent to the workers."""
        env: dict[fx.Node, Any] = {}
        bindings: dict[int, dict[str, Any]] = {}
        for node, value in zip(lowered.inputs, self.bind_inputs(lowered, batch)):
            if isinstance(node.meta["spec"], S.ModelSpec):
                for rank in self.groups[node.meta["role"]].ranks:
                    bindings.setdefault(rank, {})[node.name] = value
            elif isinstance(node.meta["spec"], S.EnvSpec):  # a name: every rank that runs a rollout resolves it
                for rank in {rank for group in self.groups.values() for rank in group.ranks}:
                    bindings.setdefault(rank, {})[node.name] = value
            env[node] = value
        self.transport.begin(bindings)
        return env

    def model_ref(self, role: str) -> ModelRef:
        """The version the controller last saw of `role` (asked once of the first rank holding it)."""
        if role not in self.versions:
            self.versions[role] = self.transport.current(role, self.groups[role].ranks[0]).version
        return ModelRef(role, self.versions[role])

    def _value(self, env: dict[fx.Node, Any], node: fx.Node) -> Any:
        """A node's value on the controller, fetched from the first rank of its group if it lives there."""
        if node in env:
            return env[node]
        return self.transport.fetch(node.name, self.groups[node.meta["role"]].ranks[0])

    # -- steps -----------------------------------------------------------------------------------
    def _run_step(self, step: Any, env: dict[fx.Node, Any]) -> None:
        if isinstance(step, Stage):
            self._run_stage(step, env)
        elif isinstance(step, Transfer):
            self._run_transfer(self._step_node(step), env)
        elif isinstance(step, SyncWeights):
            self._run_sync(self._step_node(step), step)
        elif isinstance(step, Offload):
            self.transport.offload(self.groups[step.group].ranks, step.group, step.direction)

    def _run_stage(self, step: Stage, env: dict[fx.Node, Any]) -> None:
        if step.group == CONTROLLER:
            for name in step.nodes:
                env[self.nodes[name]] = run_node(self.nodes[name], env, self._primitive)
        else:
            self.transport.run(self._key, self.groups[step.group].ranks, step.nodes)

    def _run_transfer(self, node: fx.Node, env: dict[fx.Node, Any]) -> None:
        source = node.args[0]
        src, dst = node.meta["layouts"]
        if src == (CONTROLLER,):
            self.transport.scatter(node.name, env[source], dst)
        elif dst == (CONTROLLER,):
            env[node] = self.transport.gather(source.name, src)
        else:
            self.transport.move(source.name, node.name, src, dst, node.kwargs["kind"], node.meta["per_row"])
        self.bytes_moved += node.kwargs["nbytes"]

    def _run_sync(self, node: fx.Node, step: SyncWeights) -> None:
        src, dst = node.meta["ranks"]
        route = SyncRoute(step.role, tuple(src), tuple(dst), step.buckets, self.compiled.options.bucket_bytes)
        self.transport.sync_weights(node.name, node.args[0].name, route)
        self.bytes_moved += step.bytes

    def _step_node(self, step: Any) -> fx.Node:
        return next(n for n in self.compiled.program.graph.nodes if n.meta.get("step") == step.index)

    def _run_filter_step(self, step: Stage, loop: Loop, env: dict[fx.Node, Any], more_prompts: MorePrompts | None) -> None:
        """The filter's stage (on the controller): `filter_groups` with its refill loop, then the reads of its outputs."""
        rounds = functools.partial(self._run_steps, loop.steps)
        for name in step.nodes:
            node = self.nodes[name]
            if primitive_name(node) == "filter_groups":
                env[node] = run_filter(node, env, self.nodes[loop.prompts], rounds, more_prompts)
            else:
                env[node] = run_node(node, env, self._primitive)

    def _run_steps(self, indices: tuple[int, ...], env: dict[fx.Node, Any]) -> None:
        """One refill round: the loop's plan steps, in order, with `env` as the controller's values."""
        for index in indices:
            self._run_step(self.compiled.plan.steps[index], env)

    # -- errors ----------------------------------------------------------------------------------
    def _context(self, step: Any) -> _StepContext:
        return _StepContext(step, self.groups)

    def close(self) -> None:
        self.transport.close()


class _StepContext:
    """Turns a worker's failure into an error naming the plan step, its stage, role and rank."""

    def __init__(self, step: Any, groups: Mapping[str, Any]):
        self.step = step
        self.groups = groups

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, traceback) -> bool:
        if not isinstance(error, WorkerFailure):
            return False
        step = error.step or self.step
        role = _role_of(step)
        where = f"rank {error.rank}" if error.rank is not None else "its ranks"
        raise PlanStepError(
            f"plan step [{step.index}] failed on {where} (role {role!r}):\n  {step.text().splitlines()[0].strip()}\n"
            f"  {error}" + (f"\n  worker traceback (last lines):\n{_indent(error.cause)}" if error.cause else "")
        ) from error


def _role_of(step: Any) -> str:
    """The role a plan step runs for: a stage's or offload's group, a sync's role, a transfer's destination."""
    if isinstance(step, (Stage, Offload)):
        return step.group
    return step.role if isinstance(step, SyncWeights) else step.dst


def _indent(text: str) -> str:
    lines = text.strip().splitlines()[-12:]
    return "\n".join("    " + line for line in lines)
