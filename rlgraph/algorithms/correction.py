"""Rollout correction shared by the policy-gradient algorithms (`tis_cap=` in GRPO and PPO).

With the correction on, an algorithm (1) recomputes the old policy's log-probs on the trainer
(`rg.logprobs(state.policy, ro)`) and uses them as the ratio's denominator, (2) weights each
token's policy-gradient loss by w = min(exp(old_lp - ro.logprobs), cap)
(`F.truncated_is_weights`), and (3) reports how far the trainer and the generator disagree:
mean and max over tokens of |old_lp - ro.logprobs|.

The weight enters as a per-token factor on the advantage. For the losses below the per-token
loss is positively homogeneous in A (w * max(-A r, -A clip(r)) = max(-(wA) r, -(wA) clip(r)) for
w > 0, and likewise for dual clip, GSPO, CISPO, GPG), so this *is* w times the per-token
surrogate, as verl's `pg_losses * rollout_is_weights`, and the fused loss kernels still apply.
`policy_loss` weights its policy-gradient term only, not its KL or entropy terms (as verl).
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

import rlgraph as rg
from rlgraph import functional as F
from rlgraph.functional.correction import check_cap
from rlgraph.errors import TraceError, user_location

# Losses whose per-token term scales with A: weighting A weights the per-token surrogate.
# clip_cov and kl_cov are not among them (they pick tokens by the covariance of A, and kl_cov's
# penalty does not scale with A), nor are losses registered elsewhere (unknown form).
WEIGHTED_BY_ADVANTAGE = ("ppo_clip", "gspo", "cispo", "gpg_loss", "policy_loss")


class Correction(NamedTuple):
    old_logprobs: Any  # f32[N,T], the trainer's log-probs of the sampled tokens under the old policy
    weights: Any       # f32[N,T], truncated importance weights, 0 at masked positions
    metrics: dict[str, Any]


def check_tis_cap(tis_cap: object, algorithm: str, loss: str = "ppo_clip") -> float | None:
    """None (correction off) or the cap as a float; a TraceError at the algorithm's line otherwise."""
    if tis_cap is None:
        return None
    where = user_location(sys._getframe(1))  # the algorithm's line, not this helper's
    try:
        cap = check_cap(tis_cap, f"{algorithm}: tis_cap")
    except (TypeError, ValueError) as exc:
        raise TraceError(str(exc), where, fix="pass a number > 0, e.g. tis_cap=2.0, or tis_cap=None for no "
                                              "correction") from None
    if loss not in WEIGHTED_BY_ADVANTAGE:
        raise TraceError(f"{algorithm}: tis_cap weights each token's loss through its advantage, which is exact only "
                         f"for losses linear in the advantage; loss={loss!r} is not one of them", where,
                         fix=f"use loss= one of {', '.join(WEIGHTED_BY_ADVANTAGE)}, or tis_cap=None")
    return cap


def rollout_correction(state: Any, ro: Any, *, cap: float, temperature: float) -> Correction:
    """The trainer's old log-probs, their truncated IS weights against `ro.logprobs`, and two metrics."""
    old_lp = rg.logprobs(state.policy, ro, temperature=temperature)    # [N, T], before the update
    gap = (old_lp - ro.logprobs).abs()                                  # [N, T], garbage where masked
    metrics = {"logprob_mismatch/mean": F.masked_mean(gap, ro.mask),    # []
               "logprob_mismatch/max": F.masked_max(gap, ro.mask)}      # []
    return Correction(old_lp, F.truncated_is_weights(old_lp, ro.logprobs, ro.mask, cap=cap), metrics)
