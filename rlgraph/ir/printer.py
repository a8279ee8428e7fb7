"""Print a Program the way JAX prints a jaxpr: one line per value with its spec.

    { lambda policy:policy@v reward:reward:reward prompts:Prompts[B,P] ; n=8 .
      let a:Rollouts[N,T] = generate[n=8 temperature=1.0 top_p=1.0 max_new_tokens=None stop=()] policy prompts
          b:f32[N] = score reward a
          ...
      in (state{policy=f}, metrics{reward=g}) }

Values get short names (a, b, ..., z, ba, bb, ...), inputs keep theirs; field reads print as
`c:f32[N,T] = a.logprobs`; an update prints its loss closure nested below it. `source=True`
appends the user's file:line to each line.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from rlgraph.ir import ops
from rlgraph.ir.program import Program, constant

_SYMBOLS = {"add": "add", "sub": "sub", "mul": "mul", "truediv": "div", "neg": "neg", "pow": "pow",
            "getitem": "getitem", "matmul": "matmul", "lt": "lt", "gt": "gt", "le": "le", "ge": "ge",
            "eq": "eq", "ne": "ne", "and_": "and", "or_": "or", "invert": "not", "floordiv": "floordiv"}


class _Names:
    def __init__(self, parent: _Names | None = None):
        self.names: dict[fx.Node, str] = {}
        self.parent = parent
        self.counter = parent.counter if parent else [0]

    def fresh(self) -> str:
        index, letters = self.counter[0], ""
        self.counter[0] += 1
        while True:
            letters = chr(ord("a") + index % 26) + letters
            index = index // 26 - 1
            if index < 0:
                return letters

    def __getitem__(self, node: fx.Node) -> str:
        if node not in self.names:
            lifted = node.meta.get("lifted_from")
            if lifted is not None and self.parent is not None:
                self.names[node] = self.parent[lifted]
            elif node.op == "placeholder":
                self.names[node] = node.target
            else:
                self.names[node] = self.fresh()
        return self.names[node]


def _format_value(value: Any, names: _Names) -> str:
    if isinstance(value, fx.Node):
        return names[value]
    if isinstance(value, slice):
        parts = ["" if v is None else _format_value(v, names) for v in (value.start, value.stop, value.step)]
        return ":".join(parts[:2] if value.step is None else parts)
    if isinstance(value, tuple):
        return "(" + ", ".join(_format_value(v, names) for v in value) + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, list):
        return "[" + ", ".join(_format_value(v, names) for v in value) + "]"
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    if isinstance(value, float):
        return repr(value)
    if callable(value):
        info = ops.op_info(value)
        return info.name if info else getattr(value, "__name__", repr(value))
    return repr(value)


def op_name(node: fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    info = ops.op_info(node.target)
    if info is not None:
        return info.name
    name = getattr(node.target, "__name__", str(node.target))
    return _SYMBOLS.get(name, name)


def _equation(node: fx.Node, names: _Names, outs: list[fx.Node]) -> str:
    lhs = " ".join(f"{names[out]}:{out.meta['spec']}" for out in outs)
    if node.target.__name__ == "get_field" if callable(node.target) else False:
        return f"{lhs} = {names[node.args[0]]}.{node.args[1]}"
    if node.target is constant:
        return f"{lhs} = const {node.args[0].tolist()}"
    params = {k: v for k, v in node.kwargs.items() if k != "stats"}
    args = list(node.args)
    if node.target is operator.getitem and not isinstance(args[1], fx.Node):
        params, args = {"index": args[1]}, args[:1]
    bracket = ""
    if params:
        bracket = "[" + " ".join(f"{k}={_format_value(v, names)}" for k, v in params.items()) + "]"
    operands = " ".join(_format_value(arg, names) for arg in args)
    return f"{lhs} = {op_name(node)}{bracket} {operands}".rstrip()


def _lines(program: Program, names: _Names, indent: str, source: bool) -> list[str]:
    inputs = [node for node in program.graph.nodes if node.op == "placeholder"]
    own = [f"{names[n]}:{n.meta['spec']}" for n in inputs if "lifted_from" not in n.meta]
    captured = [f"{names[n]}:{n.meta['spec']}" for n in inputs if "lifted_from" in n.meta]
    hparams = " ".join(f"{k}={v!r}" for k, v in program.hparams.items())
    head = " ".join(own) + (" ; " + " ".join(captured) if captured else "") + (" ; " + hparams if hparams else "")
    lines = [f"{indent}{{ lambda {head} ."]
    width = len(indent) + 6
    first = True
    for node in program.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.target is operator.getitem and isinstance(node.args[0], fx.Node) and _is_tuple(node.args[0]):
            continue  # printed with the tuple-producing node
        outs = [user for user in node.users if user.target is operator.getitem] if _is_tuple(node) else [node]
        text = _equation(node, names, outs)
        where = node.meta.get("source")
        if source and where is not None:
            text += f"    # {where}"
        lines.append(f"{indent}  {'let ' if first else '    '}{text}")
        first = False
        if "program" in node.meta:
            lines.append(f"{' ' * width}{node.meta['program'].name} =")
            lines.extend(_lines(node.meta["program"], _Names(names), " " * (width + 2), source))
    value, metrics = program.output.args[0]
    shown_metrics = ", ".join(f"{k}={names[v]}" for k, v in metrics.items())
    if isinstance(value, dict):
        shown_value = "state{" + ", ".join(f"{k}={names[v]}" for k, v in value.items()) + "}"
    else:
        shown_value = names[value]
    outputs = program.output.kwargs.get("outputs", {})
    shown_outputs = ", {" + ", ".join(f"{k}={names[v]}" for k, v in outputs.items()) + "}" if outputs else ""
    lines.append(f"{indent}  in ({shown_value}, {{{shown_metrics}}}{shown_outputs}) }}")
    return lines


def _is_tuple(node: fx.Node) -> bool:
    from rlgraph.ir.specs import TupleSpec

    return isinstance(node.meta.get("spec"), TupleSpec)


def format_program(program: Program, *, source: bool = False) -> str:
    return "\n".join(_lines(program, _Names(), "", source))
