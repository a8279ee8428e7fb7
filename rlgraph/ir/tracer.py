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
import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx as fx

from rlgraph.batches import Prompts, Rollouts
from rlgraph.ir import ops
from rlgraph.ir import specs as S
from rlgraph.errors import TraceError, user_location
from rlgraph.ir.infer import get_field, infer
from rlgraph.ir.program import constant
from rlgraph.ir.purity import install_refusals, python_value_error, refuse_inplace_node


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
        if callable(a) and not isinstance(a, type):  # fx would fail deep inside with "argument of type: function"
            name = getattr(a, "__qualname__", repr(a))
            raise TraceError(f"the plain Python function {name!r} cannot be passed to a traced op", user_location(),
                             fix=f"decorate it with @rg.traceable so the compiler can record it (e.g. an aggregation "
                                 f"passed as agg=), or pass one of rlgraph.functional's (F.token_mean, ...)")
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
        if isinstance(spec, (S.RewardSpec, S.EnvSpec, S.StatsSpec)):
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
