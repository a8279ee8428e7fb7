"""Execute a compiled plan, step by step, in this process.

The runner walks `plan.steps` and runs exactly the program nodes each step names: stages run
their nodes (primitives on the executor, math on the controller), transfers and weight syncs run
their nodes too (in one process the data is already in place, so they pass values through, and
the runner counts the bytes the plan said they move). The same executor protocol serves the
eager interpreter, so compiled and eager runs are compared number for number in the tests.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from rlgraph.backends.protocols import Executor
from rlgraph.passes.pipeline import Compiled
from rlgraph.plan.plan import Offload, Stage, SyncWeights, Transfer
from rlgraph.runtime.eager import Interpreter, flatten_metrics, run_node


class PlanRunner(Interpreter):
    def __init__(self, compiled: Compiled, executor: Executor):
        super().__init__(executor)
        self.compiled = compiled
        self.nodes = {node.name: node for node in compiled.program.graph.nodes}
        self.bytes_moved = 0

    def run(self, program: Any, batch: Any = None) -> tuple[dict[str, Any], dict[str, float]]:
        """`run(batch)`, or `run(program, batch)` for the Trainer's interface (the program is the compiled one)."""
        batch = program if batch is None else batch
        lowered = self.compiled.program
        env: dict[fx.Node, Any] = dict(zip(lowered.inputs, self.bind_inputs(lowered, batch)))
        for step in self.compiled.plan.steps:
            if isinstance(step, Offload):
                continue  # one process: nothing leaves the device
            if isinstance(step, (Transfer, SyncWeights)):
                self.bytes_moved += step.bytes
            names = step.nodes if isinstance(step, Stage) else [n.name for n in lowered.graph.nodes if n.meta.get("step") == step.index]
            for name in names:
                node = self.nodes[name]
                env[node] = run_node(node, env, self._primitive)
        state, metrics = fx.node.map_arg(lowered.output.args[0], env.__getitem__)
        return state, flatten_metrics(metrics)
