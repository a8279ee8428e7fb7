"""Tracing entry points: `trace_algorithm` (an `@rg.algorithm` function into a `Program`) and
`trace_loss` (an `rg.update` loss closure, by a child tracer), with the checks on what the user's
function takes and returns: record types of its inputs, hyper-parameters, metrics, refill loops.
"""

from __future__ import annotations

import difflib
import inspect
import itertools
from collections.abc import Callable, Mapping
from typing import Any

import torch.fx as fx

from rlgraph.batches import Prompts, Rollouts
from rlgraph.ir import ops
from rlgraph.ir import specs as S
from rlgraph.errors import SpecError, TraceError, user_location
from rlgraph.ir.primitives import RefillLoop, ancestors, primitive_name, refill_loops
from rlgraph.ir.program import Program
from rlgraph.ir.infer import infer
from rlgraph.ir.tracer import Handle, StateView, TracedValue, Tracer


# -- tracing entry points -----------------------------------------------------------------------

DEFAULT_ROLES: dict[str, S.Spec] = {
    "policy": S.ModelSpec("policy"),
    "ref": S.ModelSpec("ref"),
    "critic": S.ModelSpec("critic", kind="critic"),
    "teacher": S.ModelSpec("teacher"),  # a frozen teacher of distillation (`distill`, `gkd`)
    "reward": S.RewardSpec("reward"),
    "env": S.EnvSpec("env"),  # what rg.rollout steps; pruned, as every role, from algorithms that do not use it
}
BATCH_TYPES: dict[Any, S.RecordSpec] = {Prompts: S.PROMPTS, Rollouts: S.ROLLOUTS, "Prompts": S.PROMPTS, "Rollouts": S.ROLLOUTS}


def positional_params(fn: Callable[..., Any]) -> list[inspect.Parameter]:
    params = inspect.signature(fn).parameters.values()
    return [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _batch_spec(param: inspect.Parameter, fn: Callable[..., Any]) -> S.RecordSpec:
    annotation = param.annotation
    if isinstance(annotation, str):
        annotation = annotation.rsplit(".", 1)[-1]
    if annotation in BATCH_TYPES:
        return BATCH_TYPES[annotation]
    raise TraceError(
        f"{fn.__name__}: parameter {param.name!r} needs a batch annotation, rg.Prompts or rg.Rollouts",
        _definition_site(fn), fix=f"def {fn.__name__}(state, {param.name}: rg.Prompts, *, ...)",
    )


def check_algorithm_call(fn: Callable[..., Any], args: tuple) -> None:
    """An algorithm called as a function: inside another algorithm's trace it is inlined, so its
    batch must be the record its annotation names; outside a trace it was called on data."""
    batch = args[1] if len(args) > 1 else None
    given = getattr(batch, "spec", None) if isinstance(batch, Handle) else type(batch).__name__
    if not ops.ACTIVE_TRACERS:
        raise TraceError(
            f"{fn.__name__} is an @rg.algorithm: it describes one iteration to trace and compile, and is not "
            f"called on data (got {', '.join(type(a).__name__ for a in args) or 'no arguments'})", user_location(),
            fix=f"compile it and run the plan on a batch: compiled = rg.compile({fn.__name__}, mesh=...); "
            "PlanRunner(compiled, executor).run(prompts) (rlgraph.runtime; `rlgraph train` does this for a config)",
        )
    params = positional_params(fn)
    if len(params) != 2 or len(args) != 2 or not isinstance(args[0], StateView):
        return  # the traced call itself reports a wrong signature or state
    expected = _batch_spec(params[1], fn)
    if not isinstance(given, S.RecordSpec) or given.kind != expected.kind:
        raise TraceError(
            f"{fn.__name__} takes {expected.kind} as its batch ({params[1].name}), got {given}", user_location(),
            fix="an algorithm over Prompts generates its own rollouts; to train on given rollouts write one whose "
            "batch is `ro: rg.Rollouts` and call rg.score / rg.logprobs / rg.update on it"
            if expected.kind == "Prompts" else "generate rollouts first: ro = rg.generate(state.policy, prompts, n=...)",
        )


def _definition_site(fn: Callable[..., Any]):
    from rlgraph.errors import SourceLocation

    code = getattr(fn, "__code__", None)
    return SourceLocation(code.co_filename, code.co_firstlineno, fn.__name__) if code else None


def trace_algorithm(fn: Callable[..., Any], *, roles: Mapping[str, S.Spec] | None = None,
                    hparams: Mapping[str, Any] | None = None) -> Program:
    """Trace one iteration `fn(state, batch, **hparams) -> (state, metrics)` into a Program."""
    roles = dict(DEFAULT_ROLES if roles is None else roles)
    params = positional_params(fn)
    if len(params) != 2:
        raise TraceError(
            f"an algorithm takes (state, batch) and keyword-only hyper-parameters; {fn.__name__} takes "
            f"{[p.name for p in params]}", _definition_site(fn),
            fix=f"def {fn.__name__}(state: rg.State, prompts: rg.Prompts, *, n=8, ...)",
        )
    batch_param = params[1]
    batch_spec = _batch_spec(batch_param, fn)
    hparams = _bind_hparams(fn, hparams or {})
    tracer = Tracer()
    with tracer:
        state = StateView({role: tracer.placeholder(role, spec) for role, spec in roles.items()}, tracer)
        batch = tracer.placeholder(batch_param.name, batch_spec)
        result = fn(state, batch, **hparams)
        new_state, metrics, outputs = _check_algorithm_result(fn, result)
        metrics = dict(metrics)
        for node in list(tracer.graph.nodes):
            if isinstance(node.meta.get("spec"), S.StatsSpec):
                metrics.setdefault(_stats_key(node.args[0]), tracer.wrap(node))
        _check_metrics(fn, metrics)
        state_out = {role: tracer.create_arg(handle) for role, handle in new_state.roles.items()}
        output = tracer.graph.output((state_out, {key: tracer.create_arg(item) for key, item in metrics.items()}))
        if outputs:  # kept beside (state, metrics), so every reader of output.args[0] is unchanged
            output.kwargs = {"outputs": {key: tracer.create_arg(item) for key, item in outputs.items()}}
    _prune_unused_roles(tracer.graph)
    loops = _check_refill_loops(tracer.graph, fn)
    return Program(fn.__name__, tracer.graph, "algorithm", hparams, {"loops": loops} if loops else {})


def _stats_key(producer: fx.Node) -> str:
    """The metrics key of a primitive's statistics: its model's role (`policy/loss`) or `filter`."""
    if primitive_name(producer) == "filter_groups":
        return "filter"
    return producer.args[0].meta["spec"].role


def _check_refill_loops(graph: fx.Graph, fn: Callable[..., Any]) -> tuple[RefillLoop, ...]:
    """The refill loops of the program, refusing what a re-run on fresh prompts would get wrong."""
    filters = [node for node in graph.nodes if primitive_name(node) == "filter_groups"]
    if len(filters) > 1:
        raise TraceError("an algorithm may call rg.filter_groups once; this one calls it again",
                         filters[1].meta.get("source"), fix="filter once, with one keep mask combining the conditions")
    loops = refill_loops(graph)
    for loop, node in zip(loops, filters):
        if not loop.prompts:
            raise TraceError("rg.filter_groups refills the batch from fresh prompts, so the algorithm's batch "
                             "must be rg.Prompts", node.meta.get("source"),
                             fix=f"def {fn.__name__}(state: rg.State, prompts: rg.Prompts, *, ...)")
        for before in itertools.takewhile(lambda n: n is not node, graph.nodes):
            if primitive_name(before) == "update":  # a re-run would repeat it, or generate with stale weights
                raise TraceError("rg.update runs before rg.filter_groups: the refill loop re-runs generation after "
                                 "it, which would repeat the update or use the old weights", before.meta.get("source"),
                                 fix="update after filtering, on the rollouts rg.filter_groups returns")
        _refuse_unfiltered_uses(graph, loop, node)
    return loops


def _refuse_unfiltered_uses(graph: fx.Graph, loop: RefillLoop, filter_node: fx.Node) -> None:
    """A value of the refill region, or the batch input the region re-reads, may feed only the
    region and the filter (or dead code)."""
    live = ancestors(next(node for node in reversed(graph.nodes) if node.op == "output"))
    region = set(loop.nodes)
    prompts = next(node for node in graph.nodes if node.op == "placeholder" and node.name == loop.prompts)
    for user in prompts.users:
        if user is not filter_node and user.name not in region and user in live:
            raise TraceError(
                f"this line reads the batch {prompts.name}:{prompts.meta['spec']} after rg.filter_groups; the "
                "filtered rollouts may come from refilled batches, so its rows no longer match their groups",
                user.meta.get("source"),
                fix="compute what needs the prompts before filtering and pass it through the filter, or read "
                "the prompts of the kept rollouts (ro.prompt_ids); a greedy baseline (ReMax) cannot follow "
                "rg.filter_groups",
            )
    for inside in (node for node in graph.nodes if node.name in region):
        for user in inside.users:
            if user is not filter_node and user.name not in region and (user in live or user.op == "output"):
                raise _unfiltered_use(inside, user, filter_node)


def _unfiltered_use(value: fx.Node, user: fx.Node, filter_node: fx.Node) -> TraceError:
    where = user.meta.get("source")
    if user.op == "output":
        state, metrics = user.args[0]
        key = next((k for k, v in {**state, **metrics}.items() if v is value), value.name)
        where, what = filter_node.meta.get("source"), f"the output {key!r}"
    else:
        what = "this line"
    return TraceError(
        f"{what} uses a value computed before rg.filter_groups ({value.name}:{value.meta['spec']}); it belongs to the "
        "unfiltered first round and is recomputed when the batch is refilled", where,
        fix="use the rollouts and rewards rg.filter_groups returns (compute other values from them after "
        "filtering), or pass the value through the filter",
    )


def _bind_hparams(fn: Callable[..., Any], given: Mapping[str, Any]) -> dict[str, Any]:
    params = {p.name: p for p in inspect.signature(fn).parameters.values() if p.kind == p.KEYWORD_ONLY}
    unknown = [name for name in given if name not in params]
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(params), n=1)
        raise TraceError(
            f"{fn.__name__} has no hyper-parameter {unknown[0]!r}; it has {', '.join(params) or 'none'}",
            _definition_site(fn), fix=f"did you mean {close[0]!r}?" if close else None,
        )
    bound = {}
    for name, param in params.items():
        if name in given:
            bound[name] = given[name]
        elif param.default is not inspect.Parameter.empty:
            bound[name] = param.default
        else:
            raise TraceError(f"{fn.__name__}: hyper-parameter {name!r} has no default and was not given", _definition_site(fn))
    return bound


def _check_algorithm_result(fn: Callable[..., Any], result: Any
                            ) -> tuple[StateView, Mapping[str, Any], Mapping[str, Any]]:
    """`(state, metrics)` or `(state, metrics, outputs)`: outputs are values handed back to the caller
    whole (per-token log-probs, rollouts), where metrics are scalars to log."""
    ok = isinstance(result, tuple) and len(result) in (2, 3) and isinstance(result[0], StateView) \
        and all(isinstance(part, Mapping) for part in result[1:])
    if not ok:
        raise TraceError(
            f"{fn.__name__} must return (state, metrics) or (state, metrics, outputs), got "
            f"{type(result).__name__}", _definition_site(fn),
            fix="return state.replace(policy=policy), {\"reward\": r.mean()}",
        )
    outputs = result[2] if len(result) == 3 else {}
    for key, value in outputs.items():
        spec = getattr(value, "spec", None)
        if not isinstance(key, str) or not isinstance(spec, (S.TensorSpec, S.RecordSpec)):
            raise TraceError(f"output {key!r} of {fn.__name__} must be a traced tensor or record under a string "
                             f"key, got {spec or type(value).__name__}", _definition_site(fn),
                             fix="return state, metrics, {\"logprobs\": lp}")
    return result[0], result[1], outputs


def _check_metrics(fn: Callable[..., Any], metrics: Mapping[str, Any]) -> None:
    for key, value in metrics.items():
        spec = getattr(value, "spec", None)
        if isinstance(spec, S.StatsSpec):
            continue
        if not isinstance(value, TracedValue) or spec.shape != ():
            raise TraceError(
                f"metric {key!r} of {fn.__name__} must be a traced scalar, got {spec or type(value).__name__}",
                _definition_site(fn), fix=f"reduce it, e.g. {{{key!r}: value.mean()}}",
            )


def _prune_unused_roles(graph: fx.Graph) -> None:
    """The output state lists the roles the iteration changed; roles it never reads lose their input."""
    output = next(node for node in reversed(graph.nodes) if node.op == "output")
    state, metrics = output.args[0]
    kept = {role: node for role, node in state.items() if node.op != "placeholder"}  # unchanged roles stay as they are
    output.args = ((kept, dict(metrics)),)
    for node in list(graph.nodes):
        if node.op == "placeholder" and not node.users:
            graph.erase_node(node)


def trace_loss(update_op: Callable[..., Any], model: Any, batch: Any, loss: Callable[..., Any], config: dict) -> Any:
    """Trace an update's loss closure into its own Program and record the `update` node."""
    parent: Tracer = ops.ACTIVE_TRACERS[-1]
    model_spec = getattr(model, "spec", None)
    if not isinstance(model_spec, S.ModelSpec):
        raise SpecError(f"rg.update: the model must be a model version such as state.policy, got {model_spec or type(model).__name__}", user_location())
    if not callable(loss):
        raise TraceError(f"rg.update: loss must be a function of the model's output, got {type(loss).__name__}", user_location())
    params = positional_params(loss)
    output_name = "values" if model_spec.kind == "critic" else "lp"
    vocab = config.get("vocab", False)
    if vocab and model_spec.kind == "critic":
        raise TraceError(f"rg.update(vocab=True) trains a language model's distribution; {model_spec} is a critic",
                         user_location(), fix="drop vocab=True for a critic")
    if not 1 <= len(params) <= (1 if model_spec.kind == "critic" or vocab else 2):
        raise TraceError(
            f"rg.update: the loss closure {loss.__name__}{inspect.signature(loss)} must take the model's "
            f"per-token {'values' if model_spec.kind == 'critic' else 'log-probs over the vocabulary' if vocab else 'log-probs (and optionally entropy)'}",
            _definition_site(loss), fix=f"def {loss.__name__}({output_name}): ...",
        )
    child = Tracer(parent)
    with child:
        rows = batch.spec.rows if isinstance(getattr(batch, "spec", None), S.RecordSpec) else S.N
        inputs = [child.placeholder(params[0].name, S.f32(rows, S.T, S.V) if vocab else S.f32(rows, S.T))]
        if len(params) == 2:
            inputs.append(child.placeholder(params[1].name, S.f32(rows, S.T)))
        result = loss(*inputs)
        value, metrics = result if isinstance(result, tuple) and len(result) == 2 else (result, {})
        if not isinstance(value, TracedValue) or value.spec.shape != () or not value.spec.dtype.is_floating_point:
            raise SpecError(
                f"the loss closure {loss.__name__} must return a float scalar (or (loss, metrics)), got "
                f"{getattr(value, 'spec', type(value).__name__)}", _definition_site(loss),
                fix="aggregate per-token losses, e.g. F.token_mean(per_token, ro.mask)",
            )
        if not isinstance(metrics, Mapping):
            raise TraceError(f"the loss closure {loss.__name__} returned metrics of type {type(metrics).__name__}; use a dict", _definition_site(loss))
        _check_metrics(loss, metrics)
        child.graph.output((child.create_arg(value), {key: child.create_arg(item) for key, item in metrics.items()}))
    program = Program(loss.__name__, child.graph, "loss", {})
    captures = list(child.lifted)
    for node in captures:
        spec = node.meta["spec"]
        if not isinstance(spec, S.TensorSpec) or (spec.shape and spec.shape[0] != rows):
            raise SpecError(
                f"the loss closure {loss.__name__} uses {node.name}:{spec}; an update's loss may only use "
                f"per-rollout values [{rows}, ...] and scalars, which are split with the micro-batches",
                _definition_site(loss),
            )
    stats = ("loss", "grad_norm", *metrics)
    args = (parent.create_arg(model), parent.create_arg(batch), *captures)
    node = parent.graph.create_node("call_function", update_op, args, dict(config, stats=stats), name="update")
    node.meta.update(source=user_location(), program=program)
    node.meta["spec"] = infer(node)
    new_model, *per_token, _stats = parent.wrap(node)
    return (new_model, *per_token) if per_token else new_model  # outputs=True: (model@v+1, outputs f32[N,T])
