from rlgraph.algorithms import reinforce_pp, reinforce_pp_baseline
from tests.algorithms._steps import two_steps


def test_reinforce_pp_puts_the_kl_in_the_token_rewards():
    text, metrics = two_steps(reinforce_pp, with_ref=True, n=2, kl=0.05, max_new_tokens=4)
    for op in ("rewards_at_last_token", "logprobs[temperature=1.0 entropy=False] ref", "kl_k1", "reinforce_pp[gamma=1.0]", "ppo_clip"):
        assert op in text, op
    assert "policy/clip_frac" in metrics and "reward" in metrics


def test_reinforce_pp_without_kl_needs_no_reference_model():
    text, _ = two_steps(reinforce_pp, n=2, max_new_tokens=4)
    assert "ref" not in text and "kl_k1" not in text


def test_the_baseline_variant_centres_per_group_and_puts_the_kl_in_the_loss():
    text, metrics = two_steps(reinforce_pp_baseline, with_ref=True, n=3, kl=0.05, max_new_tokens=4)
    assert "reinforce_pp_baseline" in text
    loss_program = text.split("loss =")[1]
    assert "kl_k3 lp" in loss_program and "ppo_clip" in loss_program
    assert "policy/approx_kl" in metrics
