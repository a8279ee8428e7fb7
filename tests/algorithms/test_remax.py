from rlgraph.algorithms import remax
from tests.algorithms._steps import two_steps


def test_remax_scores_a_greedy_baseline_per_prompt():
    text, metrics = two_steps(remax, n=2, max_new_tokens=4)
    assert "generate[n=1 temperature=0.0" in text and text.count("= score reward") == 2
    assert "= remax " in text and "ppo_clip" in text
    assert 0.0 <= metrics["greedy_reward"] <= 1.0 and "policy/clip_frac" in metrics
