"""Per-token KL estimators between the policy and a reference, and entropy from logits.

All estimators take log-probs of the *sampled* tokens, `lp` (policy, usually with gradients) and
`ref` (reference), both f32[N,T], and return f32[N,T]. Estimators of KL(pi || ref) from
J. Schulman, "Approximating KL divergence" (2020); names and clamps follow verl `kl_penalty`.
Aggregate them with a loss aggregation, e.g. `token_mean(kl_k3(lp, ref), mask)`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from rlgraph.functional.aggregate import masked_mean
from rlgraph.ir.ops import traceable


@traceable(rows="row")
def kl_k1(lp: Tensor, ref: Tensor) -> Tensor:
    """k1 = lp - ref: unbiased, high variance, can be negative (verl "kl"/"k1")."""
    return lp - ref  # [N, T]


@traceable(rows="row")
def kl_abs(lp: Tensor, ref: Tensor) -> Tensor:
    """|lp - ref| (verl "abs")."""
    return (lp - ref).abs()  # [N, T]


@traceable(rows="row")
def kl_k2(lp: Tensor, ref: Tensor) -> Tensor:
    """k2 = 0.5 (lp - ref)^2: biased, low variance, >= 0 (verl "mse"/"k2")."""
    return 0.5 * (lp - ref).square()  # [N, T]


@traceable(rows="row")
def kl_k3(lp: Tensor, ref: Tensor) -> Tensor:
    """k3 = exp(ref - lp) - (ref - lp) - 1: unbiased, low variance, >= 0 (verl "low_var_kl"/"k3").

    As verl: the log-ratio is clamped to [-20, 20] and the result to [-10, 10], so it is finite
    for any inputs (the gradient is 0 where a clamp is active).
    """
    log_ratio = (ref - lp).clamp(-20.0, 20.0)  # [N, T]
    return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(-10.0, 10.0)  # [N, T]


kl_mse = kl_k2
kl_low_var = kl_k3

@traceable
def adaptive_kl_coef(coef: Tensor, kl: Tensor, mask: Tensor, *, target: float, horizon: float) -> Tensor:
    """The next coefficient f32[] of an adaptive KL penalty (Ziegler et al., 2019, arXiv 1909.08593):

        e     = clip(KL / target - 1, -0.2, 0.2),  KL = mean over rows of each row's token mean
        coef' = coef * (1 + e * N / horizon)

    `kl` f32[N,T] is the per-token KL of this batch (e.g. `kl_k1(old_lp, ref)`), N its rows. The
    coefficient grows while the policy drifts further than `target` from the reference and
    shrinks otherwise. Source: verl `AdaptiveKLController` (same clip, n_steps = batch size).
    Rows without tokens count as KL 0 (rlgraph's masked-mean convention).
    """
    if target <= 0 or horizon <= 0:
        raise ValueError(f"adaptive_kl_coef: target and horizon must be > 0, got {target}, {horizon}")
    current = masked_mean(kl, mask, dim=-1).mean()  # [] mean over rows of each row's token mean
    error = (current / target - 1.0).clamp(-0.2, 0.2)  # []
    return (coef * (1.0 + error * kl.shape[0] / horizon)).detach()  # []


# Names used by configs and by verl's `kl_penalty`; a plain lookup, e.g. KL_ESTIMATORS["k3"](lp, ref).
KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "k1": kl_k1, "kl": kl_k1, "abs": kl_abs, "k2": kl_k2, "mse": kl_k2, "k3": kl_k3, "low_var_kl": kl_k3,
}


@traceable
def entropy_from_logits(logits: Tensor) -> Tensor:
    """H = -sum(p log p), p = softmax(z) over the last dim: f32[N,T,V] -> f32[N,T].

    Equal to verl's logsumexp(z) - sum(p z); vocabulary entries with z = -inf (p = 0) add 0.
    """
    log_probs = torch.log_softmax(logits, dim=-1)  # [N, T, V]
    probs = log_probs.exp()  # [N, T, V]
    return -torch.where(probs > 0, probs * log_probs, 0.0).sum(dim=-1)  # [N, T]
