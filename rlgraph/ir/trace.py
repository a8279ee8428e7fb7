"""The tracer: runs an `@rg.algorithm` function on proxies and records a typed `Program`.

Every recorded node gets a spec at once (`infer`), so a shape or dtype mistake raises a
`SpecError` that names the user's line while the user's code is still on the stack, the way JAX
tracer errors do. Python control flow on a traced value is refused with a `TraceError`.

Nested tracing: the loss closure given to `rg.update` is traced by a child tracer into its own
`Program`. Values of the enclosing program it uses are *lifted*: they become placeholders of the
loss program and arguments of the `update` node, so the closure is a pure function of its inputs.
All recording goes to the innermost active tracer (`ops.ACTIVE_TRACERS[-1]`).
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import itertools
import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx as fx

from rlgraph.batches import Prompts, Rollouts
from rlgraph.ir import ops
from rlgraph.ir import specs as S
from rlgraph.ir.errors import SpecError, TraceError, user_location
from rlgraph.ir.primitives import RefillLoop, ancestors, primitive_name, refill_loops
from rlgraph.ir.program import Program, constant
from rlgraph.ir.trace_checks import install_refusals, python_value_error, refuse_inplace_node


class TracedValue(fx.Proxy):
    """A traced tensor. Torch functions, operators and tensor methods on it are recorded."""

    @property
    def tracer(self) -> Tracer:  # type: ignore[override]
        return ops.ACTIVE_TRACERS[-1] if ops.ACTIVE_TRACERS else self._owner

    @tracer.setter
    def tracer(self, value: Tracer) -> None:
        self._owner = value

    @property
    def spec(self) -> S.TensorSpec:
        return self.node.meta["spec"]

    def __getattr__(self, name: str) -> Any:
        if name in ("shape", "dtype", "ndim"):
            spec = self.node.meta["spec"]
            return {"shape": spec.shape, "dtype": spec.dtype, "ndim": len(spec.shape)}[name]
        if name.startswith("__"):
            raise AttributeError(name)
        return super().__getattr__(name)

    def size(self, dim: int | None = None) -> Any:
        shape = self.node.meta["spec"].shape
        return shape if dim is None else shape[dim]

    def dim(self) -> int:
        return len(self.node.meta["spec"].shape)

    # Reading a traced value's Python value is refused before it is recorded: on meta witnesses it
    # would fail as a "mismatch" whose fix (broadcasting) misleads.
    def item(self) -> Any:
        raise python_value_error(".item()")

    def tolist(self) -> Any:
        raise python_value_error(".tolist()")

    def numpy(self, *args: Any, **kwargs: Any) -> Any:
        raise python_value_error(".numpy()")

    def __float__(self) -> float:
        raise _control_flow_error("float()")

    def __int__(self) -> int:
        raise _control_flow_error("int()")

    def __index__(self) -> int:
        raise _control_flow_error("use as an index")

    def __complex__(self) -> complex:
        raise _control_flow_error("complex()")

    def __repr__(self) -> str:
        return f"Traced<{self.node.name}: {self.node.meta.get('spec')}>"


install_refusals(TracedValue)  # x += 1, x[0] = 1, np.asarray(x), torch.tensor(x): refused at the user's line


def _control_flow_error(what: str) -> TraceError:
    return TraceError(
        f"{what} on a traced value: its value is not known while the algorithm is traced",
        user_location(),
        fix="express the choice as tensor math (torch.where, masks, clamp) so it is part of the "
        "dataflow, or make it a Python hyper-parameter (a keyword argument of the algorithm)",
    )


# torch ops whose output size depends on the values (not only the shapes) of their inputs
DATA_DEPENDENT_OPS = ("nonzero", "unique", "masked_select", "argwhere", "unique_consecutive", "bincount",
                      "repeat_interleave")


def _data_dependent_error(node: fx.Node, what: str) -> TraceError:
    return TraceError(
        f"{what} gives a result whose size depends on the data (data-dependent shape), which a "
        "traced program cannot have: every value's shape is fixed by B, n, N, T and P", node.meta.get("source"),
        fix="keep the shape and mask instead, e.g. torch.where(r > 0, r, 0) or F.masked_mean(x, mask) rather "
        "than r[r > 0]; count with (r > 0).sum() rather than len(torch.unique(r))",
    )


class Handle:
    """A traced non-tensor value (a record, a model version, a reward role): no tensor math."""

    def __init__(self, node: fx.Node, owner: Tracer):
        object.__setattr__(self, "node", node)
        object.__setattr__(self, "_owner", owner)

    @property
    def spec(self) -> Any:
        return self.node.meta["spec"]

    def __bool__(self) -> bool:
        raise _control_flow_error("bool()")

    def __setattr__(self, name: str, value: Any) -> None:  # ro.mask = m would silently change nothing traced
        raise TraceError(f"{self.spec} is immutable; cannot set {name!r}", user_location(),
                         fix="compute a new tensor and use it directly (e.g. mask = ro.mask & keep[:, None])")

    def __repr__(self) -> str:
        return f"Traced<{self.node.name}: {self.spec}>"


class RecordHandle(Handle):
    """A traced `Prompts` or `Rollouts`: `ro.logprobs` reads a field as a traced tensor."""

    def __getattr__(self, name: str) -> TracedValue:
        spec: S.RecordSpec = self.spec
        if name.startswith("__"):
            raise AttributeError(name)
        field_spec = spec.field(name)
        if field_spec is None:
            hint = difflib.get_close_matches(name, spec.field_names, n=1)
            raise TraceError(
                f"{spec.kind} has no field {name!r}; its fields are {', '.join(spec.field_names)}",
                user_location(), fix=f"did you mean {hint[0]!r}?" if hint else None,
            )
        return self._owner.field(self, name)

    def __len__(self) -> int:
        raise _control_flow_error("len()")


class ModelHandle(Handle):
    """A traced model version such as `policy@v`; pass it to `rg.generate`, `rg.logprobs`, ..."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise TraceError(
            f"{self.spec} is a model handle and has no attribute {name!r}",
            user_location(), fix="use the primitives: rg.generate, rg.logprobs, rg.values, rg.update",
        )


class StateView:
    """The traced `state`: one handle per role; `state.replace(policy=new)` returns a new view.

    Besides models and rewards, a state may carry scalars from one iteration to the next
    (`state.carry("kl_coef", init=0.1)`, e.g. an adaptive KL coefficient): an input of the program
    like a model version, replaced like one, kept by the runtime and saved in checkpoints.
    """

    def __init__(self, roles: Mapping[str, Handle], tracer: Tracer | None = None):
        object.__setattr__(self, "_roles", dict(roles))
        object.__setattr__(self, "_tracer", tracer)

    def __getattr__(self, name: str) -> Handle:
        roles = object.__getattribute__(self, "_roles")
        if name in roles:
            return roles[name]
        if name.startswith("__"):
            raise AttributeError(name)
        hint = difflib.get_close_matches(name, list(roles), n=1)
        raise TraceError(
            f"state has no field {name!r}; its roles are {', '.join(roles)}", user_location(),
            fix=f"did you mean {hint[0]!r}?" if hint else "declare the role when you trace/run the algorithm",
        )

    def __setattr__(self, name: str, value: Any) -> None:
        raise TraceError("state is immutable", user_location(), fix=f"return state.replace({name}=...)")

    def carry(self, name: str, *, init: float) -> TracedValue:
        """The value of carried scalar `name` f32[] this iteration (`init` in the first one).

        Return the next value with `state.replace(name=new)`; the runtime feeds it back next
        iteration and checkpoints it. Calling `carry` again with the same name returns the same value.
        """
        roles = object.__getattribute__(self, "_roles")
        tracer = object.__getattribute__(self, "_tracer")
        if not isinstance(init, (int, float)) or isinstance(init, bool):
            raise TraceError(f"state.carry({name!r}, init=...): init must be a number (a hyper-parameter), "
                             f"got {type(init).__name__}", user_location())
        if name in roles:
            existing = roles[name].node.meta.get("carry")
            if existing is None:
                raise TraceError(f"state.carry({name!r}): {name!r} is already a role of the state", user_location(),
                                 fix="pick another name for the carried value")
            if existing["init"] != float(init):
                raise TraceError(f"state.carry({name!r}) was declared with init={existing['init']}, now {init}",
                                 user_location())
            return roles[name]
        if not name.isidentifier():
            raise TraceError(f"state.carry: {name!r} is not a valid name", user_location())
        graph = tracer.graph
        first = next((node for node in graph.nodes if node.op != "placeholder"), None)
        with graph.inserting_before(first) if first is not None else contextlib.nullcontext():
            node = graph.placeholder(name)
        node.meta.update(spec=S.f32(), carry={"init": float(init)}, source=user_location())
        roles[name] = tracer.wrap(node)
        return roles[name]

    def replace(self, **updates: Handle) -> StateView:
        roles = dict(object.__getattribute__(self, "_roles"))
        for name, value in updates.items():
            if name not in roles:
                raise TraceError(f"state.replace: no role {name!r}; roles are {', '.join(roles)}", user_location(),
                                 fix=f"declare a carried scalar first: state.carry({name!r}, init=...)")
            if "carry" in roles[name].node.meta:
                spec = getattr(value, "spec", None)
                if not isinstance(value, TracedValue) or spec.shape != () or not spec.dtype.is_floating_point:
                    raise TraceError(f"state.replace({name}=...): the carried value {name!r} is f32[], got "
                                     f"{spec if spec is not None else type(value).__name__}", user_location(),
                                     fix="reduce it to a scalar, e.g. .mean()")
                roles[name] = value
                continue
            old, new = roles[name].spec, getattr(value, "spec", None)
            if not isinstance(new, type(old)) or getattr(new, "role", None) != old.role:
                raise TraceError(
                    f"state.replace({name}=...) expects a version of {old.role}, got {new if new else type(value).__name__}",
                    user_location(),
                )
            roles[name] = value
        return StateView(roles, object.__getattribute__(self, "_tracer"))

    @property
    def roles(self) -> dict[str, Handle]:
        return dict(object.__getattribute__(self, "_roles"))


class Tracer(fx.proxy.TracerBase):
    """Records into one `fx.Graph`; a child tracer (loss closures) lifts values of its parent."""

    def __init__(self, parent: Tracer | None = None):
        self.graph = fx.Graph()
        self.parent = parent
        self.lifted: dict[fx.Node, fx.Node] = {}  # parent node -> our placeholder
        self.scope = fx.proxy.Scope("", None)
        self.module_stack = {}
        self.node_name_to_scope = {}
        self._fields: dict[tuple[fx.Node, str], TracedValue] = {}

    # -- recording ---------------------------------------------------------------------------
    def proxy(self, node: fx.Node) -> TracedValue:
        return TracedValue(node, self)

    def create_arg(self, a: Any) -> Any:
        if isinstance(a, (TracedValue, Handle)):
            return self._local(a.node)
        if isinstance(a, torch.Tensor):
            if a.numel() > 4096:
                raise TraceError(
                    f"a tensor constant of shape {tuple(a.shape)} is captured by the algorithm", user_location(),
                    fix="pass large data through prompts/rollouts or the state; constants must be small",
                )
            node = self.graph.create_node("call_function", constant, (a.detach().clone(),), {}, name="const")
            node.meta["spec"] = S.TensorSpec(tuple(a.shape), a.dtype)
            return node
        if ops.op_info(a) is not None:  # a traceable function passed as an argument (agg=F.token_mean)
            return a
        if isinstance(a, (StateView, Prompts, Rollouts)):
            raise TraceError(f"a {type(a).__name__} cannot be an argument here", user_location())
        return super().create_arg(a)

    def _local(self, node: fx.Node) -> fx.Node:
        """`node` as seen from this graph: itself, or a placeholder lifted from an enclosing graph."""
        if node.graph is self.graph:
            return node
        if node not in self.lifted:
            assert self.parent is not None, "a value from an unrelated graph"
            self.parent._local(node)  # make sure every level in between sees it too
            last_input = [n for n in self.graph.nodes if n.op == "placeholder"][-1]
            with self.graph.inserting_after(last_input):  # inputs first: own, then captured in order
                placeholder = self.graph.placeholder(node.name)
            placeholder.meta["spec"] = node.meta["spec"]
            placeholder.meta["lifted_from"] = node
            self.lifted[node] = placeholder
        return self.lifted[node]

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None) -> fx.Node:  # noqa: D401
        refuse_inplace_node(kind, target, kwargs)
        node = self.graph.create_node(kind, target, args, kwargs, name, type_expr)
        node.meta["source"] = user_location()
        if kind in ("call_function", "call_method"):
            try:
                node.meta["spec"] = infer(node)
            except TraceError:
                self.graph.erase_node(node)
                raise
        return node

    def to_bool(self, obj: fx.Proxy) -> bool:
        raise _control_flow_error("Python `if`/`while`/`and`/`or`/bool()")

    def iter(self, obj: fx.Proxy):
        raise _control_flow_error("Python `for` / unpacking")

    def keys(self, obj: fx.Proxy):
        raise _control_flow_error("`**` unpacking")

    def record_op(self, op: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Called by `@traceable` functions and primitives: one node, wrapped by its spec."""
        node = self.create_node("call_function", op, self.create_arg(args), self.create_arg(kwargs))
        return self.wrap(node)

    def wrap(self, node: fx.Node) -> Any:
        spec = node.meta["spec"]
        if isinstance(spec, S.TupleSpec):
            items = []
            for index, item in enumerate(spec.items):
                getter = self.graph.create_node("call_function", operator.getitem, (node, index), {})
                getter.meta.update(spec=item, source=node.meta.get("source"))
                items.append(self.wrap(getter))
            return tuple(items)
        if isinstance(spec, S.RecordSpec):
            return RecordHandle(node, self)
        if isinstance(spec, S.ModelSpec):
            return ModelHandle(node, self)
        if isinstance(spec, (S.RewardSpec, S.StatsSpec)):
            return Handle(node, self)
        return TracedValue(node, self)

    def field(self, record: RecordHandle, name: str) -> TracedValue:
        key = (record.node, name)
        if key not in self._fields:
            node = self.graph.create_node("call_function", get_field, (record.node, name), {}, name=name)
            node.meta.update(spec=record.spec.field(name), source=user_location())
            self._fields[key] = TracedValue(node, self)
        return self._fields[key]

    def placeholder(self, name: str, spec: S.Spec) -> Any:
        node = self.graph.placeholder(name)
        node.meta["spec"] = spec
        return self.wrap(node)

    # -- scoping -----------------------------------------------------------------------------
    def __enter__(self) -> Tracer:
        ops.ACTIVE_TRACERS.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        popped = ops.ACTIVE_TRACERS.pop()
        assert popped is self


def get_field(record: Any, name: str) -> Any:
    """Target of field reads (`ro.logprobs`)."""
    return getattr(record, name)


# -- spec inference -----------------------------------------------------------------------------


def infer(node: fx.Node) -> S.Spec:
    """The spec of a call node: the op's own rule if it has one, else a run on witness tensors."""
    info = ops.op_info(node.target) if node.op == "call_function" else None
    if info is not None and info.spec_rule is not None:
        arg_specs = fx.node.map_arg(node.args, lambda a: a.meta["spec"])
        kwarg_specs = fx.node.map_arg(node.kwargs, lambda a: a.meta["spec"])
        return info.spec_rule(*arg_specs, **kwarg_specs)
    if node.op == "call_function" and node.target is get_field:
        return node.args[0].meta["spec"].field(node.args[1])
    if node.op == "call_function" and node.target is constant:
        return S.TensorSpec(tuple(node.args[0].shape), node.args[0].dtype)
    if node.op == "call_function" and node.target is operator.getitem and not _is_tensor(node.args[0]):
        container = node.args[0].meta["spec"]
        return container.items[node.args[1]]
    return _infer_by_witness(node, info)


def _is_tensor(node: Any) -> bool:
    return isinstance(node, fx.Node) and isinstance(node.meta.get("spec"), S.TensorSpec)


def _infer_by_witness(node: fx.Node, info: ops.OpInfo | None) -> S.Spec:
    def witness(arg: fx.Node) -> Any:
        spec = arg.meta["spec"]
        if not isinstance(spec, S.TensorSpec):
            raise TraceError(f"{_op_name(node)} got {spec}, which is not a tensor", node.meta.get("source"))
        return spec.witness()

    args = fx.node.map_arg(node.args, witness)
    kwargs = fx.node.map_arg(node.kwargs, witness)
    try:
        if node.op == "call_method":
            result = getattr(args[0], node.target)(*args[1:], **kwargs)
        else:
            fn = info.impl if info is not None else node.target
            result = fn(*args, **kwargs)
    except TraceError:
        raise
    except (RuntimeError, TypeError, ValueError, IndexError, NotImplementedError) as exc:
        what = _data_dependent(node, args, exc)
        if what is not None:
            raise _data_dependent_error(node, what) from None
        raise _mismatch(node, exc) from None
    return _spec_of_result(node, result)


def _data_dependent(node: fx.Node, args: Any, exc: Exception) -> str | None:
    """The op's name when it failed on its witnesses because its output size depends on the data:
    a boolean index (`r[r > 0]`) or an op such as torch.unique that meta tensors cannot size."""
    if getattr(node.target, "__name__", "") == "getitem" and len(args) > 1:
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        if any(isinstance(part, torch.Tensor) and part.dtype == torch.bool for part in index):
            return "boolean indexing (x[mask])"
    text = str(exc)
    named = any(name in _op_name(node) or f"aten::{name}" in text or f"torch.{name}()" in text
                for name in DATA_DEPENDENT_OPS)
    return _op_name(node) if named else None


def _spec_of_result(node: fx.Node, result: Any) -> S.Spec:
    if isinstance(result, torch.Tensor):
        return S.spec_of_tensor(result)
    if isinstance(result, (tuple, list)) and all(isinstance(item, torch.Tensor) for item in result):
        return S.TupleSpec(tuple(S.spec_of_tensor(item) for item in result))
    if isinstance(result, dict) and all(isinstance(item, torch.Tensor) for item in result.values()):
        raise TraceError(
            f"{_op_name(node)} returns a dict; traced ops must return a tensor or a tuple of tensors",
            node.meta.get("source"),
        )
    raise TraceError(
        f"{_op_name(node)} returned a {type(result).__name__}, which rlgraph cannot trace "
        "(traced code must stay in tensors)", node.meta.get("source"),
        fix="keep the value as a tensor (e.g. use x.sum() rather than x.sum().item())",
    )


def _op_name(node: fx.Node) -> str:
    if node.op == "call_method":
        return f".{node.target}()"
    info = ops.op_info(node.target)
    if info is not None:
        return info.name
    name = getattr(node.target, "__name__", str(node.target))
    return {"add": "+", "sub": "-", "mul": "*", "truediv": "/", "getitem": "indexing", "matmul": "@"}.get(name, name)


def _mismatch(node: fx.Node, exc: Exception) -> SpecError:
    operands = [f"{arg.name}:{arg.meta['spec']}" for arg in node.all_input_nodes if "spec" in arg.meta]
    reason = _translate_sizes(str(exc).splitlines()[0])
    return SpecError(
        f"shape/dtype mismatch in {_op_name(node)} on {', '.join(operands) or 'constants'}: {reason}",
        node.meta.get("source"),
        fix="check the symbolic dims of the operands (N rollouts, T response tokens, P prompt tokens, "
        "B prompts); broadcast explicitly, e.g. adv[:, None] for a per-rollout value against [N, T]",
    )


def _translate_sizes(text: str) -> str:
    """Replace witness sizes in torch's message by dim names: `(35) ... (11)` -> `(N) ... (T)`."""
    import re

    def name(match: re.Match) -> str:
        value = int(match.group(0))
        symbolic = S.symbolic_size(value)
        return str(symbolic)

    return re.sub(r"(?<![\w.])\d+(?![\w.])", name, text)


# -- tracing entry points -----------------------------------------------------------------------

DEFAULT_ROLES: dict[str, S.Spec] = {
    "policy": S.ModelSpec("policy"),
    "ref": S.ModelSpec("ref"),
    "critic": S.ModelSpec("critic", kind="critic"),
    "reward": S.RewardSpec("reward"),
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
    from rlgraph.ir.errors import SourceLocation

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
        new_state, metrics = _check_algorithm_result(fn, result)
        metrics = dict(metrics)
        for node in list(tracer.graph.nodes):
            if isinstance(node.meta.get("spec"), S.StatsSpec):
                metrics.setdefault(_stats_key(node.args[0]), tracer.wrap(node))
        _check_metrics(fn, metrics)
        outputs = {role: tracer.create_arg(handle) for role, handle in new_state.roles.items()}
        tracer.graph.output((outputs, {key: tracer.create_arg(item) for key, item in metrics.items()}))
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


def _check_algorithm_result(fn: Callable[..., Any], result: Any) -> tuple[StateView, Mapping[str, Any]]:
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], StateView) and isinstance(result[1], Mapping)):
        raise TraceError(
            f"{fn.__name__} must return (state, metrics), got {type(result).__name__}", _definition_site(fn),
            fix="return state.replace(policy=policy), {\"reward\": r.mean()}",
        )
    return result


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
    if not 1 <= len(params) <= (1 if model_spec.kind == "critic" else 2):
        raise TraceError(
            f"rg.update: the loss closure {loss.__name__}{inspect.signature(loss)} must take the model's "
            f"per-token {'values' if model_spec.kind == 'critic' else 'log-probs (and optionally entropy)'}",
            _definition_site(loss), fix=f"def {loss.__name__}({output_name}): ...",
        )
    child = Tracer(parent)
    with child:
        rows = batch.spec.rows if isinstance(getattr(batch, "spec", None), S.RecordSpec) else S.N
        inputs = [child.placeholder(params[0].name, S.f32(rows, S.T))]
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
    new_model, _stats = parent.wrap(node)
    return new_model
