import pytest
import torch

from rlgraph.algorithms import dapo
from rlgraph.algorithms.dapo import overlong_penalty
from rlgraph.errors import TraceError
from tests.algorithms._steps import two_steps


def test_overlong_penalty_is_zero_then_linear_down_to_minus_one():
    lengths = torch.tensor([0, 6, 7, 8, 10, 12])
    mask = torch.arange(12)[None, :] < lengths[:, None]  # [6, 12]
    torch.testing.assert_close(overlong_penalty(mask, max_length=10, buffer=4),
                               torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))


def test_dapo_filters_groups_shapes_rewards_clips_higher_and_averages_over_tokens():
    text, metrics = two_steps(dapo, n=4, max_new_tokens=4, overlong_buffer=2)
    assert "group_has_variance b c" in text and "filter_groups[max_rounds=4] a b d" in text
    assert "overlong_penalty[max_length=4 buffer=2]" in text
    assert "ppo_clip[clip_low=0.2 clip_high=0.28 agg=token_mean]" in text
    assert metrics["shaped_reward"] <= metrics["reward"] and "policy/clip_frac" in metrics
    assert 1 <= metrics["filter/rounds"] <= 4 and 0 <= metrics["filter/kept_groups"] <= 1


def test_dapo_without_dynamic_sampling_has_no_filter():
    text, metrics = two_steps(dapo, n=4, max_new_tokens=4, overlong_buffer=2, dynamic_sampling=False)
    assert "filter_groups" not in text and "filter/rounds" not in metrics


@pytest.mark.parametrize("max_new_tokens, buffer", [(4, 4), (5, 4), (5, 3)])
def test_a_buffer_over_half_the_budget_is_refused_at_the_algorithms_line(max_new_tokens, buffer):
    """The default buffer 4 with the math example's max_new_tokens=5 would punish nearly every response."""
    with pytest.raises(TraceError, match=rf"dapo: overlong_buffer={buffer} covers {buffer} of max_new_tokens={max_new_tokens}"
                                         rf"(.|\n)*at .*dapo.py:\d+ in dapo\(\)(.|\n)*fix: pass overlong_buffer <= {max_new_tokens // 2}"):
        dapo.trace(max_new_tokens=max_new_tokens, overlong_buffer=buffer)
    dapo.trace(max_new_tokens=max_new_tokens, overlong_buffer=buffer, overlong_coef=0.0)  # switched off: nothing to refuse
    dapo.trace(max_new_tokens=2 * buffer, overlong_buffer=buffer)  # half the budget: DAPO's own is a fifth
