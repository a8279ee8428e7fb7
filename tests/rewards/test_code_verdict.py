"""The parent's half of the code reward: how tests are split, and how claimed values are judged."""

from __future__ import annotations

import ast
import sys
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlgraph.errors import ConfigError
from rlgraph.rewards import CodeTests
from rlgraph.rewards.code_verdict import UnverifiableTest, plan_tests
from rlgraph.rewards.sandbox import bwrap_failure

needs_bwrap = pytest.mark.skipif(bwrap_failure(sys.executable) is not None,
                                 reason="the bubblewrap sandbox cannot run here: apt-get install bubblewrap")


def verdict(test: str, **claims: str | None) -> bool:
    """The verdict of one test when the sandbox claims `claims` (leaf source -> repr) for its leaves."""
    plan = plan_tests([test])
    steps = plan.completion_tests[0]["steps"] + plan.reference_tests[0]["steps"]
    leaves = {step[1]: claims[step[2]] for step in steps if step[0] == "eval" and step[2] in claims}
    return plan.passed(leaves, set(), set())[0]


def steps(test: str, run: str = "completion") -> list[list[str]]:
    plan = plan_tests([test])
    return (plan.completion_tests if run == "completion" else plan.reference_tests)[0]["steps"]


def test_an_equality_sends_only_the_left_side():
    assert steps("assert add(1, 2) == 3") == [["eval", "0.0.0", "add(1, 2)"]]
    assert verdict("assert add(1, 2) == 3", **{"add(1, 2)": "3"})
    assert not verdict("assert add(1, 2) == 3", **{"add(1, 2)": "4"})


@pytest.mark.parametrize("claim", [None, "<__main__.Any object at 0x7f>", "True", "'3'", "[3]", "3 if 1 else 0",
                                   "9" * 5000, "[" * 10_000 + "]" * 10_000, "x" * (2 << 20)])
def test_a_claim_that_is_not_the_plain_value_fails(claim):
    # Raised (None), not a literal, the wrong type, an expression, too many digits, too deep, too long.
    assert not verdict("assert add(1, 2) == 3", **{"add(1, 2)": claim})


def test_the_parent_applies_builtins_comparisons_and_short_circuits_itself():
    test = "assert sorted(f([3, 1])) == [1, 3] and len(f([3, 1])) == 2"
    assert [s[2] for s in steps(test)] == ["f([3, 1])", "f([3, 1])"]  # sorted/len stay with the parent
    assert verdict(test, **{"f([3, 1])": "[3, 1]"}) and not verdict(test, **{"f([3, 1])": "[2, 2]"})
    guarded = "assert f(1) is None or f(1)[0] == 1"
    assert verdict(guarded, **{"f(1)": "None"}) and verdict(guarded, **{"f(1)": "(1, 2)"})
    assert not verdict(guarded, **{"f(1)": "(2,)"}) and not verdict(guarded, **{"f(1)": "5"})  # 5[0]: TypeError
    assert verdict("assert abs(f(2) - 1.41) < 0.01", **{"f(2)": "1.414"})
    assert not verdict("assert not is_prime(8)", **{"is_prime(8)": "True"})
    close = "import math\nassert math.isclose(area(2), 12.56, rel_tol=0.001)"
    assert [s[2] for s in steps(close) if s[0] == "eval"] == ["area(2)"]  # isclose is the parent's
    assert verdict(close, **{"area(2)": "12.566"}) and not verdict(close, **{"area(2)": "True"})
    assert [s[2] for s in steps("assert sorted(f(), key=len) == []")] == ["sorted(f(), key=len)"]  # key: a leaf


def test_expected_values_the_test_computes_stay_out_of_the_completions_run():
    test = "expected = sorted([2, 1])\nx = [3, 1]\nassert f(x) == expected"
    assert steps(test) == [["exec", "x = [3, 1]"], ["eval", "0.2.0", "f(x)"]]
    assert steps(test, "reference") == [["exec", "expected = sorted([2, 1])"], ["exec", "x = [3, 1]"],
                                        ["eval", "0.2.1", "expected"]]
    assert verdict(test, **{"f(x)": "[1, 2]", "expected": "[1, 2]"})
    # Imports and statements binding nothing go to the completion's run (it may rely on them); a
    # reference implementation the test defines does not.
    test = "import sys\nsys.setrecursionlimit(5000)\ndef ref(n):\n    return 2 * n\nassert f(3) == ref(3)"
    assert [s[1] if s[0] == "exec" else s[2] for s in steps(test)] == ["import sys", "sys.setrecursionlimit(5000)", "f(3)"]
    assert "ref(3)" in [s[2] for s in steps(test, "reference") if s[0] == "eval"]
    # A name bound from the completion's values is the completion's: it runs there, in order.
    assert steps("y = f(2)\nassert y == 4") == [["exec", "y = f(2)"], ["eval", "0.1.0", "y"]]


def test_a_repeated_sequence_from_claimed_values_is_bounded():
    start = time.perf_counter()
    assert not verdict("assert f(1) * f(2) == ''", **{"f(1)": "'ab'", "f(2)": "1000000000000"})
    assert not verdict("assert f(1) % f(2) == ''", **{"f(1)": "'%*d'", "f(2)": "(1000000000, 1)"})
    assert verdict("assert f(1) % 7 == 3", **{"f(1)": "10"})
    assert time.perf_counter() - start < 1.0  # refused before building 2e12 characters or a 1 GB string


@pytest.mark.parametrize("test", ["def check(candidate):\n    assert candidate(1) == 2\ncheck(f)",
                                  "for i in range(3):\n    assert f(i) == i", "f(1)", "x = f(1)"])
def test_tests_without_top_level_asserts_are_unverifiable(test):
    with pytest.raises(UnverifiableTest):
        plan_tests([test])
    assert plan_tests([test], allow_forgeable=True).completion_tests == [{"opaque": test}]


def test_bad_test_rows_are_config_errors_naming_row_and_test():
    with pytest.warns(RuntimeWarning):
        reward = CodeTests(isolation="none")
    with pytest.raises(ConfigError, match=r"(?s)row 1.s .tests., test 0, cannot be checked.*allow_forgeable_tests=True"):
        reward(["x = 1", "x = 2"], tests=["assert x == 1", ["for i in range(2):\n    assert x"]])
    for bad in ("assert x ==", "assert x == 1\0", "assert " + "(" * 10_000 + ")" * 10_000):
        with pytest.raises(ConfigError, match=r"row 0's 'tests', test 1, is not valid Python"):
            reward(["x = 1"], tests=[["assert x == 1", bad]])


@needs_bwrap
def test_forgeable_tests_run_only_when_allowed():
    humaneval = "def check(candidate):\n    assert candidate(2) == 4\ncheck(double)"
    reward = CodeTests(timeout_s=5, allow_forgeable_tests=True)
    assert reward(["def double(x): return 2 * x", "def double(x): return x"], tests=[humaneval, humaneval]) == [1.0, 0.0]


@given(st.lists(st.sampled_from(["f(1)", "g(x)", "x", "3", "[1, 2]", "len(f(2))", "sorted(g(1))", "f(1)[0]"]),
                min_size=2, max_size=4), st.sampled_from(["==", "!=", "<", "in", "is not"]))
def test_every_leaf_is_a_completion_expression_and_the_check_has_no_calls_but_builtins(parts, op):
    test = f"assert {parts[0]} {op} {' + '.join(parts[1:])}"
    plan = plan_tests([test])
    for check in plan.checks[0]:
        for node in ast.walk(check):
            if isinstance(node, ast.Call):
                assert isinstance(node.func, ast.Name) and node.func.id in ("len", "sorted")
            if isinstance(node, ast.Name) and node.id not in ("len", "sorted"):
                assert node.id.startswith("__leaf_")


@pytest.mark.filterwarnings("ignore:code. isolation=.none.:RuntimeWarning")  # the harness is the same in both
def test_honest_values_of_every_plain_kind_cross_intact():
    code = ("def inf(): return float('-inf')\ndef one(): return (1,)\ndef span(): return range(3)\n"
            "def frozen(): return frozenset({1, 2})\ndef nested(): return {'a': [b'x', 1.5, None, {2}], 3: (1+2j,)}\n"
            "def gen(): return (i * i for i in range(3))")
    tests = ["assert inf() == -float('inf')", "assert one() == (1,)", "assert list(span()) == [0, 1, 2]",
             "assert frozen() == {1, 2}", "assert nested() == {'a': [b'x', 1.5, None, {2}], 3: (1+2j,)}",
             # Iterators and ranges cross as lists (so this passes where Python says False: documented);
             # a tuple stays a tuple, so the last one fails as it would in Python.
             "assert gen() == [0, 1, 4]", "assert one() == [1]"]
    reward = CodeTests(timeout_s=10, isolation="none")
    assert reward.run(code, "asserts", tests) == {"passed": 6, "error": None, "timed_out": False}


CLAIMS = st.one_of(st.none(), st.text(max_size=12), st.integers(-10**6, 10**6).map(str),
                   st.sampled_from(["[]", "None", "'%*d'", "(1000000000, 1)", "(1,)", "{1: 2}", "1e999", "-1e999", "[[]]",
                                    "b'x'", "1j", "{1, 2}", "'abc'", "[3, 1, 2]", "True", "0"]))
SHAPES = ["assert sorted(f(1)) == [1] and len(f(2)) > 0 or f(1) % 3 == f(2) * 2",
          "assert f(1)[f(2)] in f(1) and -f(2) <= abs(f(1)) // f(2)",
          "assert math.isclose(f(1), f(2), rel_tol=f(1)) and max(f(1)) is not min(f(2), f(1))",
          "assert {f(1): f(2)}[f(1)] == set(f(2)) - {1} and sum(f(1)) / round(f(2), 2) != 0"]


@given(st.sampled_from(SHAPES), CLAIMS, CLAIMS)
def test_any_claimed_values_give_a_verdict_never_an_exception(shape, first, second):
    # Whatever the sandbox reports, the parent answers True or False, in bounded time.
    start = time.perf_counter()
    assert verdict("import math\n" + shape, **{"f(1)": first, "f(2)": second}) in (True, False)
    assert time.perf_counter() - start < 1.0


@pytest.mark.filterwarnings("ignore:code. isolation=.none.:RuntimeWarning")  # counting runs, not isolating
def test_a_groups_completions_share_one_reference_run(monkeypatch):
    from rlgraph.rewards import code_exec
    requests = []
    real = code_exec.run_sandboxed
    monkeypatch.setattr(code_exec, "run_sandboxed", lambda script, stdin, *rest: requests.append(stdin) or
                        real(script, stdin, *rest))
    test = "expected = sorted([3, 1, 2])\nassert f() == expected"
    group = ["def f(): return [1, 2, 3]", "def f(): return [3, 2, 1]", "def f(): return sorted([2, 3, 1])"]
    reward = CodeTests(timeout_s=10, isolation="none", workers=2)
    assert reward(group, tests=[test] * 3) == [1.0, 0.0, 1.0]
    assert len(requests) == 4  # three completions, one reference run
    assert reward.run(group[0], "asserts", [test]) == {"passed": 1, "error": None, "timed_out": False}  # alone
