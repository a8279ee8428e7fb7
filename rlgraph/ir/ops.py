"""`@traceable`: make a pure tensor function one op of the IR.

Called on concrete tensors, a traceable function simply runs. Called while an algorithm is being
traced with at least one traced value among its arguments, it records *one* node whose target is
the function itself, so printed programs read `adv:f32[N] = group_normalize r group` instead of a
dozen scatter ops, and the fusion pass can match it by identity.

Spec rules: by default the function is run on meta tensors whose sizes witness the symbolic dims
(see `rlgraph.ir.specs`), which checks shapes and dtypes at trace time. A function that cannot run
on meta tensors (data-dependent shapes) registers an explicit `spec` rule instead:
`spec(*arg_specs, **kwarg_specs) -> TensorSpec`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import attrs
import torch.fx

# The stack of active tracers, innermost last. Pushed and popped by `rlgraph.ir.tracer` only.
ACTIVE_TRACERS: list[Any] = []

# Every traceable op by name, for configs and the CLI.
OPS: dict[str, Callable[..., Any]] = {}


@attrs.frozen
class OpInfo:
    name: str
    impl: Callable[..., Any]
    spec_rule: Callable[..., Any] | None = None
    rows: str | None = None  # "row": output row i reads only input row i; "group": only row i's group; None: any row


def contains_proxy(tree: Any) -> bool:
    if isinstance(tree, torch.fx.Proxy):
        return True
    if isinstance(tree, (list, tuple)):
        return any(contains_proxy(item) for item in tree)
    if isinstance(tree, dict):
        return any(contains_proxy(item) for item in tree.values())
    return False


def traceable(fn: Callable[..., Any] | None = None, *, name: str | None = None, spec: Callable[..., Any] | None = None,
              rows: str | None = None):
    """Decorator: `@traceable` or `@traceable(name=..., spec=rule, rows="row"|"group")`.

    `rows` says which rows of its per-row inputs each output row depends on: "row" (only its own),
    "group" (only those of its group: `group` ids are local to a shard holding whole groups), or
    None (any: a batch statistic). The compiler runs an op on a data-parallel shard only when it
    says "row" or "group"; other math on per-row values runs on the controller, over the whole batch.
    """
    if rows not in (None, "row", "group"):
        raise ValueError(f"traceable: rows must be None, 'row' or 'group', got {rows!r}")

    def wrap(impl: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(impl)
        def op(*args: Any, **kwargs: Any) -> Any:
            if ACTIVE_TRACERS and contains_proxy((args, kwargs)):
                return ACTIVE_TRACERS[-1].record_op(op, args, kwargs)
            return impl(*args, **kwargs)

        info = OpInfo(name or impl.__name__, impl, spec, rows)
        op.__rlgraph_op__ = info  # type: ignore[attr-defined]
        OPS[info.name] = op
        return op

    return wrap(fn) if fn is not None else wrap


def op_info(target: Any) -> OpInfo | None:
    return getattr(target, "__rlgraph_op__", None)
