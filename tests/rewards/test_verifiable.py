import pytest

from rlgraph.rewards import BUILTIN, build_reward, exact_match


def test_exact_match_strips_whitespace():
    assert exact_match([" 12\n", "13", "", "1 2"], answer=["12", "12", "12", "12"]) == [1.0, 0.0, 0.0, 0.0]


def test_exact_match_ignores_other_meta_fields():
    assert exact_match(["7"], answer=[7], text=["3+4="]) == [1.0]


def test_exact_match_needs_one_answer_per_row():
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        exact_match(["1", "2"], answer=["1"])


def test_registry():
    assert build_reward("exact_match") is exact_match is BUILTIN["exact_match"]
    with pytest.raises(ValueError, match="unknown reward 'f1'; built-in rewards: exact_match"):
        build_reward("f1")
