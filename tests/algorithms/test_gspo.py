from rlgraph.algorithms import gspo
from tests.algorithms._steps import two_steps


def test_gspo_clips_the_sequence_ratio():
    text, metrics = two_steps(gspo, n=4, max_new_tokens=4)
    assert "group_normalize b c" in text and "gspo[clip_low=0.0003 clip_high=0.0004]" in text
    assert 0.0 <= metrics["policy/clip_frac"] <= 1.0 and "reward" in metrics
