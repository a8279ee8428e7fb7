"""Tools (`rlgraph/agents/tools.py`): the built-ins, and a tool's failures as text for the model."""

import time

import pytest

from rlgraph.agents.tools import MAX_OUTPUT_CHARS, Tool, calculate, calculator, python, run_tool, search
from rlgraph.errors import ConfigError


@pytest.mark.parametrize("expression, value", [("12*34", "408"), ("(3+4)*-2", "-14"), ("7/2", "3.5"), ("2**10", "1024"),
                                               ("10//3 + 10%3", "4"), (" 6 / 3 ", "2")])
def test_calculator_computes_arithmetic(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression, message", [
    ("__import__('os').system('true')", "only numbers and"),  # no names, calls or attributes: never eval
    ("9**9**9", "too large"),                                    # would take minutes to compute
    ("1/0", "division by zero"),
    ("2 +", "cannot parse"),
    ("1" * 300, "longer than 200"),
])
def test_calculator_refuses_what_is_not_small_arithmetic(expression, message):
    result = run_tool({"calculator": calculator()}, "calculator", {"expression": expression})
    assert result.error == "raised" and message in result.text


def test_a_tool_that_raises_hangs_or_floods_becomes_a_counted_error_text():
    def slow(x):
        time.sleep(3)
        return x

    tools = {tool.name: tool for tool in (
        Tool("boom", {"type": "object", "properties": {"x": {}}}, lambda x: 1 / 0),
        Tool("slow", {"type": "object", "properties": {"x": {}}}, slow, timeout_s=0.1),
        Tool("flood", {"type": "object", "properties": {"x": {}}}, lambda x: "y" * 5_000_000),
        Tool("echo", {"type": "object", "properties": {"x": {}}, "required": ["x"]}, lambda x: x))}
    assert run_tool(tools, "boom", {"x": 1}).text == "error: boom raised ZeroDivisionError: division by zero"
    started = time.perf_counter()
    hung = run_tool(tools, "slow", {"x": 1})
    assert hung.error == "timeout" and time.perf_counter() - started < 2
    flood = run_tool(tools, "flood", {"x": 1})
    assert flood.error is None and flood.truncated and len(flood.text) < MAX_OUTPUT_CHARS + 50
    assert flood.text.endswith(f"[truncated {5_000_000 - MAX_OUTPUT_CHARS} characters]")
    assert run_tool(tools, "nope", {}).error == "unknown_tool"
    assert "did you" not in run_tool(tools, "nope", {}).text and "boom, echo, flood, slow" in run_tool(tools, "nope", {}).text
    assert run_tool(tools, "echo", {}).text == "error: echo: missing x argument(s); it takes x"
    assert run_tool(tools, "echo", {"x": 1, "z": 2}).error == "bad_arguments"
    assert run_tool(tools, "echo", [1, 2]).error == "bad_arguments"
    assert run_tool(tools, "echo", ["hi"]).text == "hi"  # positional, by the schema's order
    assert run_tool(tools, "echo", "hi").error == "bad_arguments"


def test_search_ranks_passages_by_shared_words():
    tool = search(["Paris is the capital of France", "Berlin is in Germany", "France borders Germany"], top_k=2)
    assert run_tool({"search": tool}, "search", {"query": "capital of France"}).text == (
        "Paris is the capital of France\nFrance borders Germany")
    assert tool.fn(query="zebra") == "no results"


@pytest.mark.parametrize("corpus, top_k", [([], 3), ("one string", 3), ([1, 2], 3), (["a"], 0), (["a"], True)])
def test_search_refuses_a_bad_corpus_or_top_k(corpus, top_k):
    with pytest.raises(ConfigError, match="search tool"):
        search(corpus, top_k)


def test_python_tool_answers_with_what_the_program_prints():
    tool = python(isolation="none", timeout_s=5.0)
    assert run_tool({"python": tool}, "python", {"code": "print(6 * 7)"}).text.strip() == "42"
    crashed = run_tool({"python": tool}, "python", {"code": "raise SystemExit(3)"})
    assert crashed.error is None and "[exit status 3]" in crashed.text  # the program failed, not the tool
    with pytest.raises(ConfigError, match="isolation must be"):
        python(isolation="docker")


@pytest.mark.parametrize("name, parameters, fn, timeout, message", [
    ("two words", {"type": "object"}, str, 1.0, "not an identifier"),
    ("ok", {"type": "array"}, str, 1.0, "JSON schema of an object"),
    ("ok", {"type": "object"}, "str", 1.0, "fn must be callable"),
    ("ok", {"type": "object"}, str, 0, "timeout_s must be a positive number"),
])
def test_a_bad_tool_is_refused_when_declared(name, parameters, fn, timeout, message):
    with pytest.raises(ConfigError, match=message):
        Tool(name, parameters, fn, timeout_s=timeout)
