"""`ToolEnv`: a text environment whose actions are tool calls, in the formats models are trained on.

    Hermes / Qwen:  <tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>
    plain:          <tool>calculator(12*34)</tool>        (for small models: the arguments are Python
                    literals, or else the raw text as the tool's first parameter)

A turn with a call gets the tool's answer as the next observation; a turn without one is the
final answer: the episode ends, with `reward(answer_text, row)` when a reward is given. A
malformed call, an unknown tool, bad arguments, a tool that raises, hangs or answers with
megabytes become an error text for the model, counted in the step's `info` (the run's metrics).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from rlgraph.agents.env import ObservationFormat, Step
from rlgraph.agents.tools import BUILTIN_TOOLS, MAX_OUTPUT_CHARS, Tool, ToolResult, run_tool
from rlgraph.errors import ConfigError


@attrs.frozen
class Call:
    """One parsed tool call; `error` is set (and name/arguments are not to be used) when malformed."""

    name: str = ""
    arguments: Any = attrs.field(factory=dict)
    error: str | None = None


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_PLAIN = re.compile(r"<tool>(.*?)</tool>", re.DOTALL)
_PLAIN_CALL = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*\((.*)\)\s*", re.DOTALL)


def parse_hermes(text: str) -> list[Call]:
    """The `<tool_call>{json}</tool_call>` calls of `text`, in order; an opened tag never closed is malformed."""
    calls = [_hermes_call(body) for body in _HERMES.findall(text)]
    if text.count("<tool_call>") > len(calls):
        calls.append(Call(error="a <tool_call> tag is not closed with </tool_call>"))
    return calls


def _hermes_call(body: str) -> Call:
    try:
        data = json.loads(body)
    except json.JSONDecodeError as error:
        return Call(error=f"the tool call is not valid JSON ({error.msg} at character {error.pos})")
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return Call(error='a tool call is {"name": "<tool>", "arguments": {...}}')
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return Call(error="the tool call's arguments are a string that is not JSON")
    return Call(data["name"], arguments)


def parse_plain(text: str) -> list[Call]:
    """The `<tool>name(args)</tool>` calls of `text`: args as Python literals (positional or
    keyword), else the raw text as one argument."""
    calls = []
    for body in _PLAIN.findall(text):
        match = _PLAIN_CALL.fullmatch(body)
        calls.append(_plain_call(match.group(1), match.group(2)) if match else
                     Call(error="a plain tool call is <tool>name(arguments)</tool>"))
    if text.count("<tool>") > len(calls):
        calls.append(Call(error="a <tool> tag is not closed with </tool>"))
    return calls


def _plain_call(name: str, raw: str) -> Call:
    try:
        node = ast.parse(f"f({raw})", mode="eval").body
        assert isinstance(node, ast.Call)
        positional = [ast.literal_eval(arg) for arg in node.args]
        keywords = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
    except (SyntaxError, ValueError, TypeError, AssertionError, MemoryError, RecursionError):
        return Call(name, [raw.strip()])  # not literals: the text itself (calculator(12*34))
    if positional and keywords:
        return Call(error="pass a plain tool's arguments all by position or all by name")
    return Call(name, keywords or positional)


@attrs.frozen
class ScoreAnswer:
    """A reward function of the library (`fn(completions, **fields) -> scores`) as a ToolEnv's
    `reward(answer_text, row)`: the final answer scored alone, with its row's fields."""

    fn: Callable[..., Any]

    def __call__(self, answer: str, row: Mapping[str, Any]) -> float:
        return float(self.fn([answer], **{key: [value] for key, value in row.items()})[0])


@attrs.frozen
class ToolEnvRecipe:
    """A picklable recipe of a `ToolEnv` of built-in tools, named with their options: a worker
    process builds the tools once (`BUILTIN_TOOLS`), then one environment per rollout row."""

    tools: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]
    format: str = "hermes"
    reward: Callable[[str, Mapping[str, Any]], float] | None = None
    max_calls: int = 4

    def build_tools(self) -> list[Tool]:
        if id(self) not in _BUILT:  # the entry keeps the recipe alive, so its id is not reused
            _BUILT[id(self)] = (self, [BUILTIN_TOOLS[name](**dict(options)) for name, options in self.tools])
        return _BUILT[id(self)][1]

    def __call__(self) -> ToolEnv:
        return ToolEnv(self.build_tools(), format=self.format, reward=self.reward, max_calls=self.max_calls)


_BUILT: dict[int, tuple[ToolEnvRecipe, list[Tool]]] = {}  # per process: a search index is built once, not once per row


PARSERS: dict[str, Callable[[str], list[Call]]] = {"hermes": parse_hermes, "plain": parse_plain}
STOPS = {"hermes": ("</tool_call>",), "plain": ("</tool>",)}  # a call's closing tag ends the policy's turn
OBSERVATION_FORMATS = {"hermes": ObservationFormat("\n<tool_response>\n", "\n</tool_response>\n"),
                       "plain": ObservationFormat("\n<result>", "</result>\n")}


class ToolEnv:
    """The policy calls `tools`; its first turn without a call is its answer.

    `format`: "hermes" or "plain" (the call syntax the parser reads); `reward(answer_text, row)`
    scores the answer (0 without one); `max_calls` calls run per turn at most (the rest are
    answered with an error); `max_chars` of each answer reach the model.
    """

    def __init__(self, tools: Sequence[Tool], *, format: str = "hermes",
                 reward: Callable[[str, Mapping[str, Any]], float] | None = None, max_calls: int = 4,
                 max_chars: int = MAX_OUTPUT_CHARS) -> None:
        if format not in PARSERS:
            raise ConfigError(f"ToolEnv: format must be one of {', '.join(PARSERS)}, got {format!r}")
        if not tools or not all(isinstance(tool, Tool) for tool in tools):
            raise ConfigError("ToolEnv: tools must be a non-empty list of rg.Tool",
                              fix="ToolEnv([rlgraph.agents.calculator()]) or your own rg.Tool(name, parameters, fn)")
        names = [tool.name for tool in tools]
        if len(set(names)) != len(names):
            raise ConfigError(f"ToolEnv: two tools share a name: {sorted(names)}")
        for name, value in (("max_calls", max_calls), ("max_chars", max_chars)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"ToolEnv: {name} must be a positive int, got {value!r}")
        if reward is not None and not callable(reward):
            raise ConfigError(f"ToolEnv: reward must be callable(answer_text, row) -> float, got {type(reward).__name__}")
        self.tools = {tool.name: tool for tool in tools}
        self.format, self.parse = format, PARSERS[format]
        self.reward, self.max_calls, self.max_chars = reward, max_calls, max_chars
        self.observation_format, self.stop = OBSERVATION_FORMATS[format], STOPS[format]
        self.row: Mapping[str, Any] = {}

    def reset(self, row: Mapping[str, Any]) -> None:
        self.row = row

    def step(self, action_text: str) -> Step:
        calls = self.parse(action_text)
        if not calls:
            reward = float(self.reward(action_text, self.row)) if self.reward is not None else 0.0
            return Step("", reward, True, {"tool_calls": 0, "tool_errors": 0})
        results = [self._run(call) for call in calls[: self.max_calls]]
        results += [ToolResult(f"error: at most {self.max_calls} tool calls a turn", "too_many")] * (len(calls) - self.max_calls)
        info = {"tool_calls": len(calls), "tool_errors": sum(r.error is not None for r in results),
                "tool_truncated": sum(r.truncated for r in results), "tool_seconds": sum(r.seconds for r in results)}
        return Step("\n".join(result.text for result in results), 0.0, False, info)

    def _run(self, call: Call) -> ToolResult:
        if call.error is not None:
            return ToolResult(f"error: {call.error}", "malformed")
        return run_tool(self.tools, call.name, call.arguments, max_chars=self.max_chars)
