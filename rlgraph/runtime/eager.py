"""The eager interpreter: runs a `Program` in-process, node by node.

This is rlgraph's reference semantics (the `eval_jaxpr` of the project): every compiled plan is
tested against it. Primitives go to an `Executor`; every other node is plain torch on the
controller. An `update` node's loss program is run per micro-batch by the executor, through a
`loss_fn` that slices the captured per-rollout values and sets the global loss normalisation.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx

from rlgraph.backends.protocols import EnvRef, Executor, LossCounts, LossFn, RewardRef, UpdateConfig
from rlgraph.batches import Rollouts, check_batch, to_device
from rlgraph.functional.aggregate import active_loss_normalization, loss_normalization
from rlgraph.ir import ops
from rlgraph.ir import specs as S
from rlgraph.ir.primitives import primitive_name
from rlgraph.ir.program import Program
from rlgraph.runtime.refill import MorePrompts, require_prompt_source, run_filter


def run_nodes(program: Program, inputs: Sequence[Any], primitive: Callable[..., Any]) -> tuple[Any, dict[str, Any]]:
    """Evaluate `program` on positional `inputs` (placeholder order); returns `(value, metrics)`."""
    env: dict[fx.Node, Any] = {}
    placeholders = program.inputs
    assert len(placeholders) == len(inputs), f"{program.name} takes {len(placeholders)} inputs, got {len(inputs)}"
    env.update(zip(placeholders, inputs))
    for node in program.graph.nodes:
        if node.op not in ("placeholder", "output"):
            env[node] = run_node(node, env, primitive)
    value, metrics = fx.node.map_arg(program.output.args[0], env.__getitem__)
    return value, dict(metrics)


def run_node(node: fx.Node, env: dict[fx.Node, Any], primitive: Callable[..., Any]) -> Any:
    """Evaluate one call node given the values of its inputs in `env`; a primitive goes to
    `primitive(node, args, kwargs)` (`call_primitive` bound to the executor that runs it)."""
    args = fx.node.map_arg(node.args, env.__getitem__)
    kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    if primitive_name(node) is not None:
        return primitive(node, args, kwargs)
    if "kernel" in node.meta:
        return call_kernel(node.meta["kernel"], args, kwargs)
    info = ops.op_info(node.target)
    return (info.impl if info else node.target)(*args, **kwargs)


# Kernels cannot read the loss-normalisation context (they import only torch and triton), so the
# runtime hands them the global counts of the mini-batch explicitly.
_COUNTED_KERNELS = {"fused_ppo_clip", "fused_policy_loss"}


def call_kernel(name: str, args: tuple, kwargs: dict) -> Any:
    """Run the fused kernel the `fuse` pass chose for a node (Triton on CUDA, torch reference on CPU)."""
    from rlgraph.kernels.registry import dispatch

    device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
    if name in _COUNTED_KERNELS:
        counts = active_loss_normalization()
        if counts is not None:
            kwargs = dict(kwargs, tokens=counts.tokens, sequences=counts.sequences, horizon=counts.horizon)
    return dispatch(name, device)(*args, **kwargs)


class Interpreter:
    """Runs algorithm programs against an executor: the reference every compiled plan is tested
    against. `run(program, batch)` takes any program; the trainer steps one program through a
    runner (`rlgraph.runtime.runner.EagerRunner` over this, or the compiled `PlanRunner`)."""

    def __init__(self, executor: Executor):
        self.executor = executor
        self.carried: dict[str, torch.Tensor] = {}  # state.carry values, fed back each iteration
        self.outputs: dict[str, Any] = {}  # the last iteration's `outputs` (an algorithm's third result)
        self._primitive = functools.partial(call_primitive, executor)

    def run(self, program: Program, batch: Any, *, more_prompts: MorePrompts | None = None
            ) -> tuple[dict[str, Any], dict[str, float]]:
        """One iteration: returns the new state refs and the metrics as floats.

        `more_prompts()` returns a fresh `Prompts` batch; only `rg.filter_groups` asks for one,
        when it re-runs its refill region (`program.annotations["loops"]`) to fill the batch.
        """
        loops = program.annotations.get("loops", ())
        require_prompt_source(loops, program, more_prompts)
        inputs = bind_inputs(program, batch, self.executor.current, self.carried)
        env: dict[fx.Node, Any] = dict(zip(program.inputs, inputs))
        filters = {loop.filter: loop for loop in loops}
        nodes = {node.name: node for node in program.graph.nodes}
        for node in program.graph.nodes:
            if node.op in ("placeholder", "output"):
                continue
            if node.name in filters:
                loop = filters[node.name]
                region = functools.partial(self._run_region, [nodes[name] for name in loop.nodes])
                env[node] = run_filter(node, env, nodes[loop.prompts], region, more_prompts)
            else:
                env[node] = run_node(node, env, self._primitive)
        state, metrics = fx.node.map_arg(program.output.args[0], env.__getitem__)
        self.outputs = {key: env[node] for key, node in program.outputs.items()}
        remember(self.carried, state)
        return state, flatten_metrics(metrics)

    def _run_region(self, region: list[fx.Node], env: dict[fx.Node, Any]) -> None:
        """One refill round: the region's nodes, in program order, in `env`."""
        for node in region:
            env[node] = run_node(node, env, self._primitive)


def remember(carried: dict[str, torch.Tensor], state: Mapping[str, Any]) -> None:
    """Keep the carried scalars of an iteration's output state for the next iteration."""
    for name, value in state.items():
        if isinstance(value, torch.Tensor):
            carried[name] = value.detach().clone()


def bind_inputs(program: Program, batch: Any, model_ref: Callable[[str], Any],
                carried: Mapping[str, torch.Tensor]) -> list[Any]:
    """A program's inputs: the live version of each model role (`model_ref(role)`), reward and env
    roles by name, carried scalars (their last value, or their `init`), the batch."""
    inputs = []
    for node in program.inputs:
        spec = node.meta["spec"]
        if isinstance(spec, S.ModelSpec):
            inputs.append(model_ref(node.target))
        elif isinstance(spec, S.RewardSpec):
            inputs.append(RewardRef(node.target))
        elif isinstance(spec, S.EnvSpec):
            inputs.append(EnvRef(node.target))
        elif "carry" in node.meta:
            inputs.append(carried.get(node.target, torch.tensor(node.meta["carry"]["init"])))
        else:
            check_batch(batch, spec.kind, program.name)
            inputs.append(batch)
    return inputs


def call_primitive(executor: Executor, node: fx.Node, args: tuple, kwargs: dict) -> Any:
    """Run primitive `node` on `executor` (the eager interpreter's, the plan runner's controller
    stages' and each worker's rank): an `update` gets its loss closure, on the executor's device."""
    name = primitive_name(node)
    assert name != "filter_groups", "filter_groups runs through run_filter, with its refill loop"
    if name == "update":
        model, batch, *captured = args
        # The loss runs where the executor trains: its captured values and batch go there too.
        device = executor.device
        batch, captured = to_device(batch, device), to_device(captured, device)
        config = UpdateConfig(**{k: v for k, v in kwargs.items() if k != "stats"},
                              grad_sync_last=node.meta.get("grad_sync_last", False))
        loss_fn = make_loss_fn(node.meta["program"], batch, captured)
        return executor.update(model, batch, loss_fn, config)
    if name == "rollout" and "env_workers" in node.meta:  # the plan's env worker processes (`place`)
        kwargs = {**kwargs, **node.meta["env_workers"]}
    return getattr(executor, name)(*args, **kwargs)


def make_loss_fn(loss: Program, batch: Rollouts, captured: Sequence[Any]) -> LossFn:
    """The closure an executor calls per micro-batch.

    Per-rollout captured values ([N, ...]) are sliced to the micro-batch rows; scalars pass whole.
    Aggregations inside the loss divide by `counts`, the token/sequence counts of the whole
    mini-batch over every data-parallel rank (the executor computes them), so the sum of the
    micro-batch losses of every rank is the mini-batch loss whatever the micro-batch size and
    the number of ranks.
    """
    rows = loss.inputs[0].meta["spec"].shape[:1]  # the model output's rows: (N,), or (B,) for n=1 rollouts
    rows_dim = [node.meta["spec"].shape[:1] == rows for node in loss.inputs if "lifted_from" in node.meta]

    def loss_fn(micro_rows: torch.Tensor, counts: LossCounts, output: torch.Tensor,
                entropy: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        sliced = [value[micro_rows] if per_row else value for value, per_row in zip(captured, rows_dim)]
        own = [output] if entropy is None or len(loss.inputs) - len(captured) == 1 else [output, entropy]
        with loss_normalization(tokens=counts.tokens, sequences=counts.sequences, horizon=batch.mask.shape[1]):
            value, metrics = run_nodes(loss, [*own, *sliced], _no_primitives)
        return value, metrics

    loss_fn.wants_entropy = len(loss.inputs) - len(captured) == 2  # type: ignore[attr-defined]
    return loss_fn


def _no_primitives(node: fx.Node, args: tuple, kwargs: dict) -> Any:
    raise AssertionError(f"primitive {node.name} inside a loss program")


def flatten_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """`{"reward": t, "policy": (ModelRef, {"loss": .., ..})}` -> `{"reward": .., "policy/loss": ..}`."""
    flat: dict[str, float] = {}
    for key, value in metrics.items():
        if isinstance(value, Mapping):
            flat.update({f"{key}/{inner}": float(v) for inner, v in value.items()})
        elif isinstance(value, torch.Tensor):
            flat[key] = float(value.detach())
        else:
            flat[key] = float(value)
    return flat
