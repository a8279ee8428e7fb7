"""Tools a `ToolEnv` runs for the policy, and the built-in ones: `calculator`, `python`, `search`.

A tool is a name, a JSON-schema of its parameters and a function of those parameters returning
text. Running one never raises and never hangs the run: a tool that raises, runs past its
timeout or answers with megabytes gives an error (or truncated) text for the model, and its
`ToolResult` says which, for the metrics.
"""

from __future__ import annotations

import ast
import concurrent.futures
import json
import math
import operator
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from rlgraph.errors import ConfigError

MAX_OUTPUT_CHARS = 2000  # what the model sees of one tool's answer; the rest is cut, marked


@attrs.frozen
class Tool:
    """`fn(**arguments) -> text`, described by `parameters` (a JSON schema of an object), e.g.

    >>> Tool("add", {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
    ...              "required": ["a", "b"]}, lambda a, b: str(a + b))
    """

    name: str
    parameters: Mapping[str, Any]
    fn: Callable[..., Any]
    description: str = ""
    timeout_s: float = 10.0

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.name):
            raise ConfigError(f"Tool name {self.name!r} is not an identifier", fix="name a tool like a Python function")
        if not isinstance(self.parameters, Mapping) or self.parameters.get("type", "object") != "object":
            raise ConfigError(f"Tool {self.name!r}: parameters must be a JSON schema of an object, got {self.parameters!r}",
                              fix='{"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}')
        if not callable(self.fn):
            raise ConfigError(f"Tool {self.name!r}: fn must be callable, got {type(self.fn).__name__}")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:
            raise ConfigError(f"Tool {self.name!r}: timeout_s must be a positive number of seconds, got {self.timeout_s!r}")

    @property
    def required(self) -> tuple[str, ...]:
        return tuple(self.parameters.get("required", ()))

    def schema(self) -> dict[str, Any]:
        """The OpenAI/Hermes function description, for a chat template's `tools=`."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                  "parameters": dict(self.parameters)}}


@attrs.frozen
class ToolResult:
    """One tool call's answer (`text`, what the model sees) and how it went (`error`: None, or
    one of "malformed", "unknown_tool", "bad_arguments", "raised", "timeout"; `truncated`)."""

    text: str
    error: str | None = None
    truncated: bool = False
    seconds: float = 0.0


# One shared pool: a hung tool keeps its thread (Python cannot kill a thread) but not the run.
_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="rlgraph-tool")


def truncate(text: str, limit: int = MAX_OUTPUT_CHARS) -> tuple[str, bool]:
    """`text` cut to `limit` characters with a note of how much was dropped."""
    if len(text) <= limit:
        return text, False
    return text[:limit] + f"... [truncated {len(text) - limit} characters]", True


def run_tool(tools: Mapping[str, Tool], name: str, arguments: Any, *, max_chars: int = MAX_OUTPUT_CHARS) -> ToolResult:
    """Call tool `name` with `arguments` (a dict, or a positional list), bounded in time and output."""
    tool = tools.get(name)
    if tool is None:
        return ToolResult(f"error: unknown tool {name!r}; the tools are {', '.join(sorted(tools)) or 'none'}",
                          "unknown_tool")
    if isinstance(arguments, Sequence) and not isinstance(arguments, str):
        names = list(tool.parameters.get("properties", {}))
        if len(arguments) > len(names):
            return ToolResult(f"error: {name} takes {len(names)} arguments ({', '.join(names)}), got {len(arguments)}",
                              "bad_arguments")
        arguments = dict(zip(names, arguments))
    if not isinstance(arguments, Mapping):
        return ToolResult(f"error: the arguments of {name} must be an object, got {type(arguments).__name__}",
                          "bad_arguments")
    missing = [key for key in tool.required if key not in arguments]
    known = tool.parameters.get("properties")  # None: the schema names no properties, any key goes
    unknown = [key for key in arguments if known is not None and key not in known]
    if missing or unknown:
        what = f"missing {', '.join(missing)}" if missing else f"unknown {', '.join(map(str, unknown))}"
        return ToolResult(f"error: {name}: {what} argument(s); it takes {', '.join(tool.parameters.get('properties', {}))}",
                          "bad_arguments")
    started = time.perf_counter()
    future = _POOL.submit(tool.fn, **arguments)
    try:
        value = future.result(timeout=tool.timeout_s)
    except concurrent.futures.TimeoutError:
        return ToolResult(f"error: {name} did not answer within {tool.timeout_s:g} s", "timeout",
                          seconds=time.perf_counter() - started)
    except Exception as error:  # noqa: BLE001 - a tool's failure is the model's observation
        text, _ = truncate(f"error: {name} raised {type(error).__name__}: {error}", max_chars)
        return ToolResult(text, "raised", seconds=time.perf_counter() - started)
    text, cut = truncate(value if isinstance(value, str) else json.dumps(value, default=str), max_chars)
    return ToolResult(text, None, cut, time.perf_counter() - started)


# -- calculator ---------------------------------------------------------------------------------

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 10**30  # operands and powers past this are refused: 9**9**9 would take the CPU for minutes


def _evaluate(node: ast.AST) -> int | float:
    """The value of an arithmetic expression tree: numbers, + - * / // % ** and parentheses only."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 100 or abs(left) > MAX_MAGNITUDE):
            raise ValueError("the power is too large")
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, complex) or (isinstance(value, (int, float)) and abs(value) > MAX_MAGNITUDE):
            raise ValueError("the result is too large")
        return value
    raise ValueError(f"only numbers and + - * / // % ** ( ) are allowed, not {type(node).__name__}")


def calculate(expression: str) -> str:
    """The value of an arithmetic `expression`, parsed with `ast` (never `eval`): '12*(3+4)' -> '84'."""
    if type(expression) in (int, float):  # a plain call's literal: calculator(12)
        expression = repr(expression)
    if not isinstance(expression, str):
        raise ValueError(f"the expression must be text, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r} as arithmetic") from None
    value = _evaluate(tree.body)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("the result is not finite")
        return str(int(value)) if value.is_integer() else f"{value:.6g}"
    return str(value)


def calculator() -> Tool:
    """Arithmetic on numbers: + - * / // % ** and parentheses."""
    return Tool("calculator", {"type": "object", "properties": {"expression": {"type": "string"}},
                               "required": ["expression"]}, calculate, "Evaluate an arithmetic expression.",
                timeout_s=2.0)


# -- python -------------------------------------------------------------------------------------


def python(isolation: str = "bwrap", timeout_s: float = 5.0, memory_mb: int = 512) -> Tool:
    """Runs a Python program in the code reward's sandbox (`rlgraph.rewards.sandbox`) and answers
    with what it printed. `isolation="none"` runs it without the sandbox: only for trusted code."""
    from rlgraph.rewards.sandbox import SandboxLimits, require_bwrap, run_sandboxed

    if isolation not in ("bwrap", "none"):
        raise ConfigError(f"python tool: isolation must be 'bwrap' or 'none', got {isolation!r}")
    if isolation == "bwrap":
        require_bwrap()  # refused when the tool is built, not at the first call
    limits = SandboxLimits(timeout_s=timeout_s, memory_mb=memory_mb, output_bytes=64 << 10)

    def run(code: str) -> str:
        outcome = run_sandboxed(code, b"", limits, isolation=isolation)
        text = outcome.stdout.decode("utf-8", "replace")
        if outcome.timed_out:
            text += f"\n[killed after {timeout_s:g} s]"
        elif outcome.output_exceeded:
            text += "\n[output cut]"
        elif outcome.returncode:
            text += f"\n[exit status {outcome.returncode}]"
        return text

    # the sandbox kills the program at its own deadline; the tool's timeout leaves room for start-up
    return Tool("python", {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}, run,
                "Run a Python program and return what it prints.", timeout_s=timeout_s + 10.0)


# -- search -------------------------------------------------------------------------------------


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def search(corpus: Sequence[str] | None = None, top_k: int = 3, corpus_file: str | None = None) -> Tool:
    """Keyword search over `corpus` (a list of passages the user gives, or the non-empty lines of
    `corpus_file`): the `top_k` passages that share the most query words, ties in corpus order."""
    if corpus_file is not None:
        from pathlib import Path

        if corpus is not None or not Path(corpus_file).is_file():
            raise ConfigError(f"search tool: corpus_file {corpus_file!r} is not a file, or a corpus is given too",
                              fix="give one of corpus (a list of passages) or corpus_file (a text file, a passage a line)")
        corpus = [line.strip() for line in Path(corpus_file).read_text().splitlines() if line.strip()]
    if corpus is None or isinstance(corpus, str) or not all(isinstance(item, str) for item in corpus) or not corpus:
        raise ConfigError("search tool: corpus must be a non-empty list of text passages",
                          fix="search(['passage one', 'passage two']); read a file's lines with Path(f).read_text().splitlines()")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ConfigError(f"search tool: top_k must be a positive int, got {top_k!r}")
    indexed = [set(_words(passage)) for passage in corpus]

    def find(query: str) -> str:
        words = set(_words(str(query)))
        scored = sorted(((len(words & passage), -i) for i, passage in enumerate(indexed)), reverse=True)
        hits = [corpus[-i] for score, i in scored[:top_k] if score > 0]
        return "\n".join(hits) if hits else "no results"

    return Tool("search", {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
                find, "Search the corpus for passages matching the query.", timeout_s=5.0)


BUILTIN_TOOLS: dict[str, Callable[..., Tool]] = {"calculator": calculator, "python": python, "search": search}
