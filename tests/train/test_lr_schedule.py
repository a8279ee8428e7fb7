"""The learning-rate schedule of `rlgraph train` (`optimizer.schedule`, `warmup_steps`, `min_lr_ratio`)."""

from __future__ import annotations

import math

import pytest

from rlgraph.train.config import TrainConfig


def lr_factor(**optimizer):
    from rlgraph.train.roles import lr_factor as factor

    steps = optimizer.pop("steps", 10)
    config = TrainConfig(data={"train": "x"}, rewards=[{"name": "math"}], train={"steps": steps}, optimizer=optimizer)
    return lambda step: factor(config, step)


def test_constant_is_one_after_a_linear_warmup():
    f = lr_factor(warmup_steps=3)
    assert [f(s) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]


@pytest.mark.parametrize("schedule, expected", [
    ("linear", lambda p: 1 - p),
    ("cosine", lambda p: 0.5 * (1 + math.cos(math.pi * p))),
])
def test_decays_reach_min_lr_ratio_at_the_last_step(schedule, expected):
    f = lr_factor(schedule=schedule, warmup_steps=2, min_lr_ratio=0.1, steps=12)
    for step in range(2, 13):
        progress = (step - 2) / 10
        assert f(step) == pytest.approx(0.1 + 0.9 * expected(progress))
    assert f(12) == pytest.approx(0.1) and f(50) == pytest.approx(0.1)


def test_a_time_bound_run_keeps_the_rate_constant():
    from rlgraph.train.roles import lr_factor as factor

    config = TrainConfig(data={"train": "x"}, rewards=[{"name": "math"}], train={"seconds": 60},
                         optimizer={"schedule": "cosine"})
    assert factor(config, 100) == 1.0
