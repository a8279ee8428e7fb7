"""The tiny world of `rlgraph.testing.tiny`: prompts of the demo task, refused when asked for none."""

import pytest

import rlgraph.testing as rgt
from rlgraph.errors import ConfigError


def test_tiny_prompts_are_the_training_split_in_order():
    first, shifted = rgt.tiny_prompts(3), rgt.tiny_prompts(2, offset=1)
    assert len(first) == 3 and first.meta["text"][1:] == shifted.meta["text"]


@pytest.mark.parametrize("args, message", [
    ((-1,), "count must be an int >= 1, got -1"),
    ((0,), "count must be an int >= 1, got 0"),
    ((2.5,), "count must be an int >= 1, got 2.5"),
    ((2, -3), "offset must be an int >= 0, got -3"),
    ((2, 10**6), "offset 1000000 \\+ count 2 is past the \\d+ training prompts"),
])
def test_tiny_prompts_refuses_counts_it_cannot_give(args, message):
    with pytest.raises(ConfigError, match=f"tiny_prompts: {message}"):
        rgt.tiny_prompts(*args)
