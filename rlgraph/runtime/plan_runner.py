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

With `staleness=k` >= 1 (`plan.overlap`) one call trains batch i and issues batch i+k's rollout
lane around it, in the order the plan gives (`Overlap.order`): batch i+k's rollout steps up to the
first that waits for the workers, batch i's train steps, the rest of batch i+k's. The transports
pipeline commands, so on split groups generation and training run at the same time; the local
transport runs each command as it is sent, on one executor holding one version, so it plays batch
i+k's whole rollout lane before batch i's train lane: the same schedule in order, same numbers. The first call also issues batches 0..k-1 (their prompts from `more_prompts`).

The transport decides only how ranks are reached: `LocalTransport` (every rank in this process),
`SpmdTransport` (one process per rank, torch.distributed), `RayTransport` (one Ray actor per rank,
in a placement group; `runtime/ray_transport.py`). The same plan runs on all three, with the same
results (tests/runtime/test_spmd.py, test_ray.py). The runner is a `Runner` bound to its plan
(`run(batch)`); the nodes it runs itself go through the eager interpreter's `run_node` and
`call_primitive`, the same functions every worker runs its stages with.
"""

from __future__ import annotations

import functools
import math
import time
import warnings
from collections.abc import Callable, Mapping, Sized
from typing import Any

import torch.fx as fx

from rlgraph.backends.protocols import Executor, ModelRef
from rlgraph.errors import RankFailure
from rlgraph.ir import specs as S
from rlgraph.errors import RLGraphError
from rlgraph.ir.primitives import primitive_name
from rlgraph.plan.compiled import Compiled
from rlgraph.plan.layouts import CONTROLLER
from rlgraph.plan.plan import Loop, Offload, Stage, SyncWeights, Transfer
from rlgraph.runtime.eager import bind_inputs, call_primitive, flatten_metrics, remember, run_node
from rlgraph.runtime.errors import PlanInputError, PlanStepError, RankMetricWarning, WorkerFailure
from rlgraph.runtime.inflight import InFlight, decode, encode, slot_name, slot_program
from rlgraph.runtime.refill import MorePrompts, require_prompt_source, run_filter
from rlgraph.runtime.runner import Runner
from rlgraph.runtime.transport import LocalTransport, SyncRoute, Transport

__all__ = ["PlanRunner", "PlanInputError", "PlanStepError", "WorkerFailure"]


class PlanRunner(Runner):
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
        self.controller = controller
        self._primitive = functools.partial(call_primitive, controller)  # the controller's stages' primitives
        self.carried: dict[str, Any] = {}
        self.outputs: dict[str, Any] = {}
        self.compiled = compiled
        self.transport = transport
        self.nodes = {node.name: node for node in compiled.program.graph.nodes}
        self.groups = {group.name: group for group in compiled.plan.groups}
        self.versions: dict[str, int] = {}
        self.bytes_moved = 0
        self.step_seconds: dict[int, float] = {}  # plan step index -> seconds spent in it, summed over runs
        self._key = f"{compiled.program.name}-{id(compiled)}"
        self._slot: int | None = None  # the batch slot the commands being sent belong to (None: synchronous)
        self.in_flight: list[InFlight] = []  # issued batches not trained yet, oldest first
        self.batches = 0  # batches issued so far
        # Asynchronous RL: called with a batch's number once its rollout lane has run (so what the
        # controller's reward functions measured since the last call belongs to that batch).
        self.on_rollout: Callable[[int], None] | None = None
        self._lanes: dict[int, str] = {}  # plan step -> the lane and batch it was last sent for
        overlap = compiled.plan.overlap
        if overlap is None:
            transport.load(self._key, compiled.program)
        for slot in range(overlap.staleness + 1 if overlap else 0):
            transport.load(slot_name(self._key, slot), slot_program(compiled.program, slot))

    def run(self, batch: Any, *, more_prompts: MorePrompts | None = None) -> tuple[dict[str, Any], dict[str, float]]:
        """One iteration of the plan on `batch` (with staleness k >= 1: batch i+k's rollout around batch i's training)."""
        lowered, plan = self.compiled.program, self.compiled.plan
        self._check_divides(batch)
        require_prompt_source(lowered.annotations.get("loops", ()), lowered, more_prompts)
        if plan.overlap is not None:
            return self._run_overlapped(batch, more_prompts)
        env = self._bind(lowered, batch)
        for step in plan.steps:
            self._timed_step(step, env, more_prompts)
        return self._finish(env)

    def _finish(self, env: dict[fx.Node, Any]) -> tuple[dict[str, Any], dict[str, float]]:
        """The iteration's state and metrics (fetched from the ranks where the output reads them, under
        the current slot), once every command sent has finished; the versions and carried values kept."""
        lowered = self.compiled.program
        with self._context(self.compiled.plan.steps[-1]):
            state, metrics = fx.node.map_arg(lowered.output.args[0], functools.partial(self._value, env))
            self.outputs = {key: self._value(env, node) for key, node in lowered.outputs.items()}
            self.transport.flush()  # every command of this iteration has finished
        self._check_rank_metrics(lowered.output.args[0][1], metrics, env)
        self.versions.update({ref.role: ref.version for ref in state.values() if isinstance(ref, ModelRef)})
        remember(self.carried, state)
        return state, flatten_metrics(metrics)

    def _timed_step(self, step: Any, env: dict[fx.Node, Any], more_prompts: MorePrompts | None, lane: str = "") -> None:
        """Run one plan step (a filter's step with its refill loop), timed; a failure names the step."""
        start = time.perf_counter()
        self.transport.at_step(step)
        if lane:  # a pipelined failure may surface steps later: it is named with the lane it was sent for
            self._lanes[step.index] = lane
        loop = next((loop for loop in self.compiled.plan.loops if loop.filter_step == step.index), None)
        with self._context(step):
            if loop is not None:
                self._run_filter_step(step, loop, env, more_prompts)
            else:
                self._run_step(step, env)
        self.step_seconds[step.index] = self.step_seconds.get(step.index, 0.0) + time.perf_counter() - start

    # -- asynchronous RL (staleness >= 1) ------------------------------------------------------------
    def _run_overlapped(self, batch: Any, more_prompts: MorePrompts | None) -> tuple[dict[str, Any], dict[str, float]]:
        """Train the oldest batch in flight while the rollout lane of a new one (on `batch`) runs.

        The first call issues batches 0..k-1 first (`batch`, then `more_prompts()`), and batch k
        (`more_prompts()`) around the training of batch 0; each later call's `batch` is batch i+k.
        """
        overlap, lowered = self.compiled.plan.overlap, self.compiled.program
        k = overlap.staleness
        if not self.in_flight and more_prompts is None:
            raise PlanInputError(f"staleness={k}: the first iteration generates {k} batch(es) ahead of the one it trains, "
                                 "but this run was given no prompt source\n  fix: pass one, e.g. runner.run(batch, "
                                 "more_prompts=lambda: next_prompts()) (the Trainer passes its next_batch)")
        self._bind(lowered, batch, tuple(range(k + 1)))  # every slot reads the live versions
        if not self.in_flight:  # the run's first call: batches 0..k-1 have no training to overlap with
            for _ in range(k):
                self.in_flight.append(self._issue(batch, overlap.rollout, more_prompts))
                self._rollout_done(self.in_flight[-1])
                batch = more_prompts()
        trained = self.in_flight.pop(0)
        live = self.model_ref(overlap.role).version  # the version batch `trained` trains (it makes live+1)
        self._refresh(trained.env, batch)
        # The local transport runs each command as it is sent on an executor that keeps one version:
        # it plays the whole rollout lane first (generation must read version i before the update
        # makes i+1), which is the same schedule in order, with the same numbers.
        split = len(overlap.rollout) if isinstance(self.transport, LocalTransport) else overlap.split
        issued = self._issue(batch, overlap.rollout[:split], more_prompts)
        self._run_lane(trained, overlap.train, more_prompts, "train")
        self._run_lane(issued, overlap.rollout[split:], more_prompts, "rollout")
        self.in_flight.append(issued)
        self._hold_in_flight()
        self._rollout_done(issued)
        self._slot = trained.slot  # the output reads the trained batch's values
        try:
            state, metrics = self._finish(trained.env)
        finally:
            self._slot = None
        lag = live - trained.version
        assert 0 <= lag <= k, (lag, k)  # the schedule's guarantee; a violation is a runner bug
        return state, {**metrics, "rollout/staleness": float(lag)}

    def _issue(self, batch: Any, steps: tuple[int, ...], more_prompts: MorePrompts | None) -> InFlight:
        """A new batch on `batch`'s prompts, generated by the live version, and its first rollout steps."""
        overlap = self.compiled.plan.overlap
        lowered = self.compiled.program
        env = dict(zip(lowered.inputs, bind_inputs(lowered, batch, self.model_ref, self.carried)))
        item = InFlight(self.batches % (overlap.staleness + 1), env, self.model_ref(overlap.role).version, self.batches)
        self.batches += 1
        self._run_lane(item, steps, more_prompts, "rollout")
        return item

    def _hold_in_flight(self) -> None:
        """The workers keep the batches in flight across iterations, also those another runner on the
        same transport begins (an evaluation between steps)."""
        self.transport.hold(self._key, tuple(slot_name(node.name, item.slot) for item in self.in_flight
                                             for node in self.compiled.program.graph.nodes if node.op != "placeholder"))

    def _rollout_done(self, item: InFlight) -> None:
        if self.on_rollout is not None:
            self.on_rollout(item.batch)

    def _run_lane(self, item: InFlight, steps: tuple[int, ...], more_prompts: MorePrompts | None, lane: str) -> None:
        self._slot = item.slot
        try:
            for index in steps:
                self._timed_step(self.compiled.plan.steps[index], item.env, more_prompts, f"{lane} lane, batch {item.batch}")
        finally:
            self._slot = None

    def _refresh(self, env: dict[fx.Node, Any], batch: Any) -> None:
        """The train lane reads the live model versions and carried values, not those of when its batch was issued."""
        lowered = self.compiled.program
        for node, value in zip(lowered.inputs, bind_inputs(lowered, batch, self.model_ref, self.carried)):
            if isinstance(node.meta["spec"], S.ModelSpec) or "carry" in node.meta:
                env[node] = value

    def _check_divides(self, batch: Any) -> None:
        """Every data-parallel rank gets the same number of whole prompts (and so of groups and
        micro-batches: ranks that disagree on the number of FSDP2 collectives would wait forever)."""
        rows = len(batch) if isinstance(batch, Sized) else None
        for group in self.compiled.plan.groups:
            ways = group.data_parallel
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
        self.in_flight, self.batches = [], 0  # batches generated before the restore belong to another trajectory
        self.transport.hold(self._key, ())

    def export_in_flight(self) -> dict[str, Any] | None:
        """The batches in flight (staleness >= 1) as plain data: each one's controller values and the
        pieces its train lane will read on each rank; None for a synchronous plan."""
        if self.compiled.plan.overlap is None:
            return None
        pieces = self._handed_off()
        batches = [{"slot": item.slot, "version": item.version, "batch": item.batch,
                    "controller": [[node.name, encode(value)] for node, value in item.env.items()],
                    "workers": [[name, rank, encode(self._fetch_in_flight(item, name, rank, index))]
                                for name, (ranks, index) in pieces.items() for rank in ranks]} for item in self.in_flight]
        return {"batches_issued": self.batches, "in_flight": batches}

    def _fetch_in_flight(self, item: InFlight, name: str, rank: int, index: int) -> Any:
        """One rank's piece of a batch in flight, for a checkpoint; a failure names the plan step that made it."""
        step = self.compiled.plan.steps[index]
        self._lanes[index] = f"checkpoint of batch {item.batch} in flight, value {name}"
        with self._context(step):
            return self.transport.fetch(slot_name(name, item.slot), rank)

    def import_in_flight(self, data: Mapping[str, Any] | None, where: str = "the checkpoint") -> None:
        """Put back what `export_in_flight` saved: the next call trains those batches."""
        overlap = self.compiled.plan.overlap
        saved = (data or {}).get("in_flight", [])
        if overlap is None or not data:
            super().import_in_flight(data, where)  # a synchronous plan: refused if the checkpoint holds any
            return
        if len(saved) != overlap.staleness:
            raise RLGraphError(f"{where} holds {len(saved)} batch(es) in flight but staleness={overlap.staleness} keeps "
                               f"{overlap.staleness}; resume with the staleness the run was saved with")
        self.in_flight, self.batches = [], int(data["batches_issued"])
        for item in saved:
            env = {self.nodes[name]: decode(value) for name, value in item["controller"]}
            for name, rank, value in item["workers"]:
                self.transport.scatter(slot_name(name, item["slot"]), decode(value), ((rank,), 1))  # the piece, as it was
            self.in_flight.append(InFlight(item["slot"], env, item["version"], item["batch"]))
        self._hold_in_flight()

    def _handed_off(self) -> dict[str, tuple[tuple[int, ...], int]]:
        """The worker-side values of the rollout lane that the train lane or the output reads: the
        ranks holding a piece of each, and the plan step that made it."""
        plan, overlap = self.compiled.plan, self.compiled.plan.overlap
        holders: dict[str, tuple[tuple[int, ...], int]] = {}
        for index in overlap.rollout:
            step = plan.steps[index]
            if isinstance(step, Stage) and step.group != CONTROLLER:
                holders.update({name: (self.groups[step.group].ranks, index) for name in step.nodes})
            elif isinstance(step, Transfer) and step.dst in self.groups:
                holders[self._step_node(step).name] = (self.groups[step.dst].ranks, index)
        readers = [self.compiled.program.output]
        for index in overlap.train:
            step = plan.steps[index]
            if isinstance(step, Stage):
                readers.extend(self.nodes[name] for name in step.nodes)
            elif not isinstance(step, Offload):  # a transfer or a weight sync: its one node
                readers.append(self._step_node(step))
        read = {arg.name for node in readers for arg in node.all_input_nodes}
        return {name: held for name, held in holders.items() if name in read}

    def write_state(self, directory: str) -> dict[str, Any] | None:
        """Each rank writes its own rows of a checkpoint into `directory` (None: one process, write it whole)."""
        return self.transport.write_state(directory)

    def read_state(self, directory: str, roles: Any, shuffle_rng: Any, sampling: Any, where: str = "the checkpoint") -> None:
        self.transport.read_state(directory, roles, shuffle_rng, sampling, where)
        self.versions.clear()

    # -- inputs and outputs --------------------------------------------------------------------
    def _bind(self, lowered: Any, batch: Any, slots: tuple[int | None, ...] = (None,)) -> dict[fx.Node, Any]:
        """The controller's inputs, and each rank's model versions sent to the workers (under each
        of `slots`' names; the values some runner holds stay on the workers)."""
        env: dict[fx.Node, Any] = {}
        bindings: dict[int, dict[str, Any]] = {}
        for node, value in zip(lowered.inputs, bind_inputs(lowered, batch, self.model_ref, self.carried)):
            if isinstance(node.meta["spec"], S.ModelSpec):
                for rank in self.groups[node.meta["role"]].ranks:
                    bindings.setdefault(rank, {}).update({slot_name(node.name, slot): value for slot in slots})
            elif isinstance(node.meta["spec"], S.EnvSpec):  # a name: every rank that runs a rollout resolves it
                for rank in {rank for group in self.groups.values() for rank in group.ranks}:
                    bindings.setdefault(rank, {}).update({slot_name(node.name, slot): value for slot in slots})
            env[node] = value
        self.transport.begin(bindings)
        return env

    def model_ref(self, role: str) -> ModelRef:
        """The version the controller last saw of `role` (asked once of the first rank holding it)."""
        if role not in self.versions:
            self.versions[role] = self.transport.current(role, self.groups[role].ranks[0]).version
        return ModelRef(role, self.versions[role])

    def _check_rank_metrics(self, nodes: Any, metrics: Any, env: dict[fx.Node, Any]) -> None:
        """Metrics a rank sent (not computed on the controller) checked where they enter: a non-finite one
        is named with the role and rank that computed it (RankMetricWarning), not met later as a null
        in metrics.jsonl. The value is kept, so every runtime reports the same numbers."""
        if not isinstance(nodes, Mapping):
            return
        for key, node in nodes.items():
            if not isinstance(node, fx.Node) or node in env:
                continue
            bad = {name: value for name, value in flatten_metrics({key: metrics[key]}).items() if not math.isfinite(value)}
            if bad:
                role = node.meta.get("role")
                rank = self.groups[role].ranks[0] if role in self.groups else "?"
                warnings.warn(f"metric {', '.join(f'{k}={v}' for k, v in bad.items())}: not finite as rank {rank} of "
                              f"role {role!r} computed it (value {node.name})", RankMetricWarning, stacklevel=3)

    def _value(self, env: dict[fx.Node, Any], node: fx.Node) -> Any:
        """A node's value on the controller, fetched from the first rank of its group if it lives there."""
        if node in env:
            return env[node]
        return self.transport.fetch(slot_name(node.name, self._slot), self.groups[node.meta["role"]].ranks[0])

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
            names = tuple(slot_name(name, self._slot) for name in step.nodes)
            self.transport.run(slot_name(self._key, self._slot), self.groups[step.group].ranks, names)

    def _run_transfer(self, node: fx.Node, env: dict[fx.Node, Any]) -> None:
        source, slot = node.args[0], self._slot
        src, dst = node.meta["layouts"]
        if src == (CONTROLLER,):
            self.transport.scatter(slot_name(node.name, slot), env[source], dst)
        elif dst == (CONTROLLER,):
            env[node] = self.transport.gather(slot_name(source.name, slot), src)
        else:
            self.transport.move(slot_name(source.name, slot), slot_name(node.name, slot), src, dst, node.kwargs["kind"],
                                node.meta["per_row"])
        self.bytes_moved += node.kwargs["nbytes"]

    def _run_sync(self, node: fx.Node, step: SyncWeights) -> None:
        src, dst = node.meta["ranks"]
        route = SyncRoute(step.role, tuple(src), tuple(dst), step.buckets, self.compiled.options.bucket_bytes)
        self.transport.sync_weights(slot_name(node.name, self._slot), slot_name(node.args[0].name, self._slot), route)
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
        return _StepContext(step, self.groups, self._lanes)

    def close(self) -> None:
        self.transport.close()


class _StepContext:
    """Turns a worker's failure into an error naming the plan step, its stage, role and rank."""

    def __init__(self, step: Any, groups: Mapping[str, Any], lanes: Mapping[int, str]):
        self.step = step
        self.groups = groups
        self.lanes = lanes  # asynchronous RL: the lane and batch each step was last sent for

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, traceback) -> bool:
        if not isinstance(error, RankFailure):  # a worker's failure, or an engine's in this process
            return False
        step = error.step or self.step
        role = _role_of(step)
        where = f"rank {error.rank}" if error.rank is not None else "its ranks"
        lane = self.lanes.get(step.index, "")
        raise PlanStepError(
            f"plan step [{step.index}] failed on {where} (role {role!r}{', ' + lane if lane else ''}):\n"
            f"  {step.text().splitlines()[0].strip()}\n"
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
