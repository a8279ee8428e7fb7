"""`ToolEnv` (`rlgraph/agents/tool_env.py`): parsing the call formats, and turns as observations."""

import pytest

from rlgraph.agents import Call, ToolEnv, calculator, parse_hermes, parse_plain
from rlgraph.errors import ConfigError


def test_hermes_calls_are_parsed_in_order_and_malformed_ones_named():
    text = ('think <tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call> then '
            '<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"x\\"}"}</tool_call>')
    assert parse_hermes(text) == [Call("calculator", {"expression": "2*3"}), Call("search", {"query": "x"})]
    assert "not valid JSON" in parse_hermes("<tool_call>{name: calculator}</tool_call>")[0].error
    assert "is not closed" in parse_hermes('<tool_call>{"name": "calculator"}')[0].error
    assert parse_hermes('<tool_call>["calculator"]</tool_call>')[0].error.startswith("a tool call is")
    assert parse_hermes("no call at all") == []


def test_plain_calls_take_literals_or_the_raw_text():
    assert parse_plain("<tool>calculator(12*34)</tool>") == [Call("calculator", ["12*34"])]
    assert parse_plain("<tool>search('capital', top=2)</tool>")[0].error is not None  # mixed
    assert parse_plain("<tool>search(query='capital')</tool>") == [Call("search", {"query": "capital"})]
    assert parse_plain("<tool>add(1, 2)</tool>") == [Call("add", [1, 2])]
    assert "is <tool>name(arguments)</tool>" in parse_plain("<tool>12*34</tool>")[0].error
    assert "is not closed" in parse_plain("<tool>calculator(1")[0].error


def test_a_call_gets_the_answer_and_a_turn_without_one_ends_with_the_reward():
    env = ToolEnv([calculator()], format="plain", reward=lambda text, row: float(text.strip() == row["answer"]))
    env.reset({"answer": "408"})
    step = env.step("<tool>calculator(12*34)</tool>")
    assert (step.observation, step.done, step.info["tool_calls"], step.info["tool_errors"]) == ("408", False, 1, 0)
    bad = env.step("<tool>calculator(12*)</tool><tool>clock()</tool><tool>calculator(1</tool>")
    assert bad.info["tool_errors"] == 3 and bad.info["tool_calls"] == 3 and not bad.done
    assert bad.observation.splitlines()[1] == "error: unknown tool 'clock'; the tools are calculator"
    final = env.step(" 408")
    assert (final.done, final.reward) == (True, 1.0)


def test_more_calls_than_max_calls_are_answered_with_an_error():
    env = ToolEnv([calculator()], format="plain", max_calls=1)
    step = env.step("<tool>calculator(1)</tool><tool>calculator(2)</tool>")
    assert step.observation == "1\nerror: at most 1 tool calls a turn" and step.info["tool_errors"] == 1


@pytest.mark.parametrize("options, message", [
    (dict(tools=[]), "non-empty list of rg.Tool"),
    (dict(tools=["calculator"]), "non-empty list of rg.Tool"),
    (dict(tools=[calculator(), calculator()]), "two tools share a name"),
    (dict(tools=[calculator()], format="xml"), "format must be one of hermes, plain"),
    (dict(tools=[calculator()], max_calls=0), "max_calls must be a positive int"),
    (dict(tools=[calculator()], reward="exact"), "reward must be callable"),
])
def test_a_bad_tool_env_is_refused(options, message):
    tools = options.pop("tools")
    with pytest.raises(ConfigError, match=message):
        ToolEnv(tools, **options)
