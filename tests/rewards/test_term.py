"""One reward term's scoring rule, the same in the controller and in a reward worker."""

import math

import pytest
import torch

from rlgraph.rewards.term import TermFailure, answer_term, run_term


def _lengths(completions, **meta):
    return [len(c) for c in completions]


def _raises(completions, **meta):
    raise ValueError("no answer here")


@pytest.mark.parametrize("returned, problem, rows, partial", [
    ("0.5", "returned str, not a list of 2 numbers", [0, 1], None),
    ([1.0], "returned 1 scores for 2 completions", [0, 1], None),
    ([1.0, math.nan], "returned nan (not finite)", [1], [1.0, 0.0]),
    ([None, 2.0], "returned NoneType None, not a number", [0], [0.0, 2.0]),
])
def test_what_a_term_returned_instead_of_one_finite_score_a_row_is_named(returned, problem, rows, partial):
    with pytest.raises(TermFailure) as failure:
        run_term(lambda completions, **meta: returned, ["a", "b"], {})
    assert (failure.value.problem, failure.value.rows, failure.value.partial, failure.value.raised) == (problem, rows, partial, False)


def test_scores_pass_as_floats_a_tensor_included_and_the_worker_answer_is_the_same_rule_as_json():
    assert run_term(_lengths, ["ab", "c"], {}) == [2.0, 1.0]
    assert run_term(lambda completions, **meta: torch.tensor([0.5, 1.5]), ["a", "b"], {}) == [0.5, 1.5]
    assert answer_term(_lengths, ["ab", "c"], {}) == {"scores": [2.0, 1.0]}
    answer = answer_term(_raises, ["a", "b"], {})
    assert answer["rows"] == [0, 1] and answer["raised"] is True and answer["partial"] is None
    assert answer["problem"].startswith("raised ValueError: no answer here (at ") and "test_term.py" in answer["problem"]
