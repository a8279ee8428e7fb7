"""Spec inference: the spec of every recorded node, found at once while the user's code is on the stack.

A node's spec comes from its op's rule in `rlgraph.ir.ops` where one is registered, else from running
the op on small witness tensors of the input specs (`_infer_by_witness`); shape and dtype errors
become `SpecError`s naming the op and the user's line, and ops whose output size depends on the
values are refused (they have no static shape).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from rlgraph.ir import ops
from rlgraph.ir import specs as S
from rlgraph.errors import SpecError, TraceError
from rlgraph.ir.program import constant


def get_field(record: Any, name: str) -> Any:
    """Target of field reads (`ro.logprobs`)."""
    return getattr(record, name)


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
