from rlgraph.algorithms import rloo
from tests.algorithms._steps import two_steps


def test_rloo_uses_the_leave_one_out_baseline():
    text, metrics = two_steps(rloo, n=4, max_new_tokens=4)
    assert "= rloo " in text and "ppo_clip" in text and "group_normalize" not in text
    assert 0.0 <= metrics["reward"] <= 1.0 and 0.0 <= metrics["policy/clip_frac"] <= 1.0
