"""Execute a compiled plan, step by step, in this process.

The runner walks `plan.steps` and runs exactly the program nodes each step names: stages run
their nodes (primitives on the executor, math on the controller), transfers and weight syncs run
their nodes too (in one process the data is already in place, so they pass values through, and
the runner counts the bytes the plan said they move). A `filter_groups` step re-runs the steps of
its `plan.loops` entry on fresh prompts. The same executor protocol serves the eager interpreter,
so compiled and eager runs are compared number for number in the tests.
"""

from __future__ import annotations

import functools
from typing import Any

import torch.fx as fx

from rlgraph.backends.protocols import Executor
from rlgraph.ir.primitives import primitive_name
from rlgraph.passes.pipeline import Compiled
from rlgraph.plan.plan import Loop, Offload, Stage, SyncWeights, Transfer
from rlgraph.runtime.eager import Interpreter, flatten_metrics, run_node
from rlgraph.runtime.refill import MorePrompts, require_prompt_source, run_filter


class PlanRunner(Interpreter):
    def __init__(self, compiled: Compiled, executor: Executor):
        super().__init__(executor)
        self.compiled = compiled
        self.nodes = {node.name: node for node in compiled.program.graph.nodes}
        self.bytes_moved = 0

    def run(self, program: Any, batch: Any = None, *, more_prompts: MorePrompts | None = None
            ) -> tuple[dict[str, Any], dict[str, float]]:
        """`run(batch)`, or `run(program, batch)` for the Trainer's interface (the program is the compiled one)."""
        batch = program if batch is None else batch
        lowered, plan = self.compiled.program, self.compiled.plan
        require_prompt_source(lowered.annotations.get("loops", ()), lowered, more_prompts)
        env: dict[fx.Node, Any] = dict(zip(lowered.inputs, self.bind_inputs(lowered, batch)))
        loop_at = {loop.filter_step: loop for loop in plan.loops}
        for step in plan.steps:
            if step.index in loop_at:
                self._run_filter_step(step, loop_at[step.index], env, more_prompts)
            else:
                self._run_step(step, env)
        state, metrics = fx.node.map_arg(lowered.output.args[0], env.__getitem__)
        self.remember(state)
        return state, flatten_metrics(metrics)

    def _step_nodes(self, step: Any) -> list[str]:
        if isinstance(step, Stage):
            return list(step.nodes)
        return [n.name for n in self.compiled.program.graph.nodes if n.meta.get("step") == step.index]

    def _run_step(self, step: Any, env: dict[fx.Node, Any]) -> None:
        if isinstance(step, Offload):
            return  # one process: nothing leaves the device
        if isinstance(step, (Transfer, SyncWeights)):
            self.bytes_moved += step.bytes
        for name in self._step_nodes(step):
            env[self.nodes[name]] = run_node(self.nodes[name], env, self._primitive)

    def _run_filter_step(self, step: Stage, loop: Loop, env: dict[fx.Node, Any], more_prompts: MorePrompts | None) -> None:
        """The filter's stage: `filter_groups` with its refill loop, then the reads of its outputs."""
        rerun = functools.partial(self._rerun_loop, loop, env)
        for name in step.nodes:
            node = self.nodes[name]
            if primitive_name(node) == "filter_groups":
                env[node] = run_filter(node, env, rerun, more_prompts)
            else:
                env[node] = run_node(node, env, self._primitive)

    def _rerun_loop(self, loop: Loop, env: dict[fx.Node, Any], prompts: Any) -> dict[fx.Node, Any]:
        """`env` with the loop's steps re-run on `prompts` (the first round's values stay in `env`)."""
        fresh = dict(env)
        fresh[self.nodes[loop.prompts]] = prompts
        for index in loop.steps:
            self._run_step(self.compiled.plan.steps[index], fresh)
        return fresh
