from rlgraph.algorithms import dr_grpo
from tests.algorithms._steps import two_steps


def test_dr_grpo_centres_without_scaling_and_normalises_by_a_constant_horizon():
    text, metrics = two_steps(dr_grpo, n=4, max_new_tokens=4)
    assert "group_normalize[scale=False]" in text
    assert "ppo_clip[clip_low=0.2 clip_high=None agg=seq_mean_token_sum_norm]" in text
    assert 0.0 <= metrics["policy/clip_frac"] <= 1.0 and "policy/approx_kl" in metrics and "reward" in metrics
