"""Rollout correction: the generator and the trainer disagree on the log-probs of the same tokens.

A bf16 generation engine (vLLM, the native engine in bf16) and an fp32 / FSDP trainer compute
slightly different log-probs for the sampled tokens, so the rollouts are not exactly on-policy for
the trainer (verl issue #2996; "When Speed Kills Stability", Liu, Li et al. 2025). The standard
correction reweights each token's policy-gradient term by a truncated importance ratio between
the trainer's and the generator's probability of the old policy:

    w_t = min(exp(lp_train_old_t - lp_rollout_t), cap)      (detached)
    L   = agg_t( w_t * surrogate_t )                          e.g. surrogate = PPO-clip's per-token loss

The ratio in the surrogate itself uses the trainer's old log-probs (`rg.logprobs` of the policy
before the update), so PPO's clipping measures the update, and `w` alone carries the mismatch.
Sources: verl `compute_policy_loss_*` (`pg_losses * rollout_is_weights`, truncate mode, token
level, log-ratio clamped before exp) and slime's TIS (`clamp(exp(old - rollout), max=tis_clip)`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rlgraph.functional.aggregate import as_mask
from rlgraph.ir.ops import traceable

LOG_RATIO_CLAMP = 20.0  # as verl: exp stays finite for any pair of log-probs


def check_cap(cap: object, name: str = "truncated_is_weights: cap") -> float:
    """`cap` as a float, or a TypeError / ValueError that says what `name` must be."""
    if isinstance(cap, bool) or not isinstance(cap, (int, float)):
        raise TypeError(f"{name} must be a number > 0 (the largest importance weight, e.g. 2.0), "
                        f"got {cap!r} of type {type(cap).__name__}")
    if math.isnan(cap) or cap <= 0:
        raise ValueError(f"{name} must be > 0 (the largest importance weight; verl and slime use 2.0), got {cap}")
    return float(cap)


@traceable(rows="row")
def truncated_is_weights(train_lp: Tensor, rollout_lp: Tensor, mask: Tensor, *, cap: float) -> Tensor:
    """Per-token truncated importance weights f32[N,T]: w = min(exp(train_lp - rollout_lp), cap).

    `train_lp` are the trainer's log-probs of the sampled tokens under the old policy (recomputed
    with `rg.logprobs`), `rollout_lp` the generator's (`ro.logprobs`). Multiply each token's
    policy-gradient loss by `w` before aggregating. Detached; 0 at masked positions; only an
    upper bound (TIS), no lower one. Log-ratio clamped to +-20 before exp. Sources: verl
    `rollout_is` (token level, truncate), slime `--use-tis`.
    """
    cap = check_cap(cap)
    mask = as_mask(mask, "truncated_is_weights")
    log_ratio = torch.where(mask, train_lp - rollout_lp, 0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [N, T]
    weights = torch.exp(log_ratio).clamp(max=cap)  # [N, T]
    return torch.where(mask, weights, 0.0).detach()  # [N, T]
