"""`train.micro_batch_tokens`: an `rlgraph train` run with packed micro-batches trains as the
padded run does, and bad budgets are named by their config key."""

from __future__ import annotations

import pytest

from rlgraph.errors import ConfigError
from rlgraph.train.run import train
from tests.train.test_run import make_config, metrics_of

SHORT = {"steps": 2, "seed": 0}


def test_a_packed_run_trains_as_the_padded_run(tmp_path):
    """Two GRPO steps (kl > 0: packed reference log-probs too) with and without packing. The
    forwards differ in fp32 summation order only, so the metrics agree closely, not bit for bit
    (tests/backends/test_packing.py derives the tolerance); the sampled tokens are the same
    (generation is untouched), so the rewards are equal."""
    padded, _ = make_config(tmp_path, "padded", train=SHORT)
    packed, _ = make_config(tmp_path, "packed", ["train.micro_batch_tokens=24"], train=SHORT)
    train(padded)
    train(packed)
    (padded_rows, packed_rows) = (metrics_of(tmp_path / name) for name in ("padded", "packed"))
    assert len(padded_rows) == len(packed_rows) > 0
    assert any(row.get("policy/grad_norm", 0) > 0 for row in padded_rows)  # the steps did learn something
    for mine, theirs in zip(packed_rows, padded_rows):
        assert mine.keys() == theirs.keys()
        for key, value in theirs.items():
            if isinstance(value, float):
                assert mine[key] == pytest.approx(value, rel=1e-3, abs=1e-5), key
            else:
                assert mine[key] == value, key


@pytest.mark.parametrize("override, expected", [
    ("train.micro_batch_tokens=0", r"train.micro_batch_tokens: Input should be greater than or equal to 1"),
    ("train.micro_batch_tokens=-8", r"train.micro_batch_tokens: Input should be greater than or equal to 1"),
    ("train.micro_batch_tokens=24.5", r"train.micro_batch_tokens: Input should be a valid integer"),
    ("train.micro_batch_tokens=many", r"train.micro_batch_tokens: Input should be a valid integer"),
])
def test_bad_budgets_name_the_key(tmp_path, override, expected):
    with pytest.raises(ConfigError, match=expected):
        make_config(tmp_path, "bad", [override])


def test_a_budget_below_the_longest_row_names_the_key_and_the_fix(tmp_path):
    config, _ = make_config(tmp_path, "short", ["train.micro_batch_tokens=5"], train=SHORT)
    with pytest.raises(ConfigError, match=r"(?s)train.micro_batch_tokens=5 is smaller than the longest row .*"
                                          r"fix: train.micro_batch_tokens >= "):
        train(config)
