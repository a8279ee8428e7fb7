"""Hyper-parameters that would train silently wrong are refused at trace time, at the algorithm's line."""

import pytest

from rlgraph.algorithms import ALGORITHMS
from rlgraph.errors import TraceError

# (algorithm, hyper-parameter, three bad values): each would have run before, wrongly or pointlessly
BAD = [
    ("grpo", "clip", [-1, -0.2, "wide"]),
    ("grpo", "kl", [-0.1, float("nan"), float("inf")]),
    ("grpo", "epochs", [0, -1, 1.5]),
    ("grpo", "micro_batch_size", [0, -4, 2.5]),
    ("grpo", "n", [0, True, "8"]),
    ("ppo", "lam", [1.5, -0.1, float("nan")]),
    ("ppo", "gamma", [1.01, -1, "one"]),
    ("ppo", "minibatches", [0, -2, None]),
    ("reinforce_pp", "gamma", [2.0, -0.5, float("inf")]),
    ("dapo", "max_rounds", [0, 1001, 10**9]),
    ("dapo", "clip_high", [-0.28, float("nan"), "x"]),
]


@pytest.mark.parametrize("algorithm, name, values", BAD, ids=[f"{a}-{n}" for a, n, _ in BAD])
def test_bad_hyper_parameter_is_refused_naming_it(algorithm, name, values):
    for value in values:
        with pytest.raises(TraceError) as exc:
            ALGORITHMS[algorithm].trace(**{name: value})
        text = str(exc.value)
        assert f"{algorithm}: {name}={value!r}" in text and "fix:" in text, text
        assert f"rlgraph/algorithms/{algorithm}.py:" in text, text  # the algorithm's line, not the helper's


@pytest.mark.parametrize("algorithm, estimator", [("grpo", "rloo"), ("grpo", "group_normalize"), ("rloo", None),
                                                  ("reinforce_pp_baseline", None), ("dapo", None)])
def test_group_estimator_with_one_sample_is_refused(algorithm, estimator):
    extra = {"estimator": estimator} if estimator else {}
    with pytest.raises(TraceError, match=r"n=1 samples per prompt.*\n.*\n  fix: pass n >= 2"):
        ALGORITHMS[algorithm].trace(n=1, **extra)


def test_boundary_values_are_accepted():
    ALGORITHMS["ppo"].trace(gamma=1.0, lam=0.0, kl=0.0, clip=0.0)
    ALGORITHMS["grpo"].trace(n=2, estimator="rloo", micro_batch_size=None)
    ALGORITHMS["dapo"].trace(max_rounds=1000)
