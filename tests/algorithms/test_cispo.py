from rlgraph.algorithms import cispo
from tests.algorithms._steps import two_steps


def test_cispo_clips_the_detached_importance_weight():
    text, metrics = two_steps(cispo, n=4, max_new_tokens=4, clip_high=0.28)
    assert "group_normalize b c" in text and "cispo[clip_low=1.0 clip_high=0.28]" in text
    assert 0.0 <= metrics["policy/clip_frac"] <= 1.0 and "reward" in metrics
