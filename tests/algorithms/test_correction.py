"""The rollout correction's claims: weighting the advantage weights each token's loss; bad caps fail at the line."""

import math

import pytest
import torch

import rlgraph.functional as F
from rlgraph.algorithms import grpo, ppo
from rlgraph.algorithms.correction import WEIGHTED_BY_ADVANTAGE
from rlgraph.errors import TraceError

from tests.functional._batches import random_batch


def _weighted(agg, weights):
    """`agg` of w * the per-token loss: the definition of the correction (verl's pg_losses * weights)."""
    return lambda per_token, mask: agg(per_token * weights, mask)


@pytest.mark.parametrize("loss, agg, hparams", [
    (F.ppo_clip, F.token_mean, {}),
    (F.ppo_clip, F.token_mean, {"dual_clip": 3.0, "clip_high": 0.28}),
    (F.gspo, F.seq_mean_token_mean, {"clip_low": 0.2, "clip_high": 0.2}),
    (F.cispo, F.token_mean, {}),
    (F.gpg_loss, F.seq_mean_token_sum_norm, {}),
])
def test_weighting_the_advantage_weights_each_tokens_loss(loss, agg, hparams):
    batch = random_batch(seed=3, n=6, t=5, token_adv=False)
    weights = F.truncated_is_weights(batch["old_lp"], batch["old_lp"] + 0.5 * torch.randn(6, 5, dtype=torch.float64),
                                     batch["mask"], cap=2.0)  # [N, T] in (0, 2]
    lp = batch["lp"].clone().requires_grad_(True)
    folded = loss(lp, batch["old_lp"], batch["adv"] * weights, batch["mask"], agg=agg, **hparams)
    direct = loss(lp, batch["old_lp"], batch["adv"], batch["mask"], agg=_weighted(agg, weights), **hparams)
    torch.testing.assert_close(folded[0], direct[0])
    torch.testing.assert_close(torch.autograd.grad(folded[0], lp)[0], torch.autograd.grad(direct[0], lp)[0])
    torch.testing.assert_close(folded[1], direct[1])  # the same tokens count as clipped


def test_policy_loss_weights_its_policy_gradient_term_only():
    batch = random_batch(seed=4, n=4, t=6, token_adv=True)
    weights = F.truncated_is_weights(batch["old_lp"], batch["lp"].detach() - 0.3, batch["mask"], cap=2.0)
    ref = batch["old_lp"] - 0.2
    value = F.policy_loss(batch["lp"], batch["old_lp"], batch["adv"] * weights, batch["mask"], ref_lp=ref,
                          kl_coef=0.1)[0]
    pg = F.ppo_clip(batch["lp"], batch["old_lp"], batch["adv"], batch["mask"], agg=_weighted(F.token_mean, weights))[0]
    torch.testing.assert_close(value, pg + 0.1 * F.token_mean(F.kl_k3(batch["lp"], ref), batch["mask"]))
    assert "policy_loss" in WEIGHTED_BY_ADVANTAGE


@pytest.mark.parametrize("algorithm", [grpo, ppo], ids=["grpo", "ppo"])
@pytest.mark.parametrize("cap, message", [
    (0.0, "tis_cap must be > 0"),
    (-2.0, "tis_cap must be > 0"),
    (math.nan, "tis_cap must be > 0"),
    ("2.0", "tis_cap must be a number > 0"),
])
def test_bad_caps_fail_while_tracing_at_the_algorithms_line(algorithm, cap, message):
    with pytest.raises(TraceError) as error:
        algorithm.trace(tis_cap=cap)
    text = str(error.value)
    assert message in text and f"{algorithm.name}.py" in text and "tis_cap=2.0" in text


@pytest.mark.parametrize("loss", ["clip_cov", "kl_cov"])
def test_losses_that_pick_tokens_by_the_advantage_are_refused(loss):
    with pytest.raises(TraceError, match=f"loss='{loss}' is not one of them"):
        grpo.trace(loss=loss, tis_cap=2.0)
