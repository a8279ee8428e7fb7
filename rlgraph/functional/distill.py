"""Distillation from frozen teachers: on-policy distillation's dense advantage and GKD's divergence.

Notation: s = pi_student(y_t | x, y_<t), t = pi_teacher(y_t | x, y_<t), log-probs `lp` (student,
with gradients in a loss), `teacher_lp`, and `sampler_lp` (the distribution the tokens were drawn
from: the student's own sampling log-probs on-policy, `ro.logprobs`). All per-token f32[N,T].

Generalised Jensen-Shannon divergence (GKD, Agarwal et al., 2024, arXiv 2306.13649, eq. 1), with
the mixture m = beta t + (1 - beta) s:

    JSD_beta(t || s) = beta KL(t || m) + (1 - beta) KL(s || m)          for 0 < beta < 1
    JSD_0 = KL(t || s)   (forward KL),   JSD_1 = KL(s || t)   (reverse KL)

Convention: TRL's `GKDTrainer` (`beta`: "0.0 is the KL divergence, 1.0 the inverse KL"), whose
interior formula is the one above; the end points are the limits of JSD_beta / beta (beta -> 0) and
JSD_beta / (1 - beta) (beta -> 1), since the unscaled JSD vanishes at both ends.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from rlgraph.functional.aggregate import as_mask, token_mean
from rlgraph.ir.ops import traceable

LOG_RATIO_CLAMP = 20.0  # as the policy losses: exp of a log-ratio stays finite


def check_beta(beta: float, where: str) -> float:
    """`beta` as a float in [0, 1], or a ValueError naming `where`."""
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta <= 1.0 or math.isnan(beta):
        raise ValueError(f"{where}: beta must be a number in [0, 1] (0 forward KL, 1 reverse KL), got {beta!r}")
    return float(beta)


@traceable(rows="row")
def distill_advantage(lp: Tensor, teacher_lp: Tensor, mask: Tensor) -> Tensor:
    """On-policy distillation's per-token advantage, f32[N,T], 0 at padding:

        A_t = -(log s(y_t) - log t(y_t))

    With tokens sampled from the student, -sum_t A_t is the k1 estimate of the sequence's reverse
    KL(s || t), so a policy gradient on A minimises it (Thinking Machines, "On-Policy
    Distillation", 2025; tinker-cookbook `distillation`). Pass the sampler's log-probs as `lp`:
    the advantage is a constant of the update, as a reward is.
    """
    mask = as_mask(mask, "distill_advantage")
    return torch.where(mask, teacher_lp - lp, 0.0)  # [N, T]


@traceable(rows="row")
def generalized_jsd(student_logprobs: Tensor, teacher_logprobs: Tensor, *, beta: float) -> Tensor:
    """JSD_beta(t || s) over the full vocabulary (module docstring), f32[...] from log-probs f32[..., V].

    Takes log-softmaxed distributions (entries of -inf are tokens of probability 0). Example: for
    s = (1/2, 1/2), t = (1, 0): JSD_0 = KL(t||s) = log 2, JSD_1 = KL(s||t) = inf, and
    JSD_1/2 = 1/2 log(4/3) + 1/2 (1/2 log(2/3) + 1/2 log 2) (m = (3/4, 1/4)).
    """
    beta = check_beta(beta, "generalized_jsd")
    if beta == 0.0:
        return _kl(teacher_logprobs, student_logprobs)  # [...]
    if beta == 1.0:
        return _kl(student_logprobs, teacher_logprobs)  # [...]
    mixture = torch.logaddexp(teacher_logprobs + math.log(beta), student_logprobs + math.log1p(-beta))  # [..., V]
    return beta * _kl(teacher_logprobs, mixture) + (1.0 - beta) * _kl(student_logprobs, mixture)  # [...]


def _kl(p_log: Tensor, q_log: Tensor) -> Tensor:
    """KL(p || q) = sum_v p (log p - log q) over the last dim; p = 0 adds 0."""
    p = p_log.exp()  # [..., V]
    return torch.where(p > 0, p * (p_log - q_log), 0.0).sum(dim=-1)  # [...]


def _sampled_terms(lp: Tensor, teacher_lp: Tensor, beta: float) -> tuple[Tensor, Tensor]:
    """Per token (h(s, t) / s, dh/ds) of JSD_beta = sum_y h(s(y), t(y)); dh/ds drops the constant 1 of
    the reverse KL (its expectation E_s[grad log s] is 0). Log-ratios are clamped to +-20."""
    log_ts = (teacher_lp - lp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [N, T] log(t / s)
    if beta == 0.0:  # h = t log(t/s)
        ratio = log_ts.exp()  # [N, T] t / s
        return ratio * log_ts, -ratio
    if beta == 1.0:  # h = s log(s/t)
        return -log_ts, -log_ts
    # log(m / s) = log(beta t/s + (1 - beta))
    log_ms = torch.logaddexp(log_ts + math.log(beta), torch.full_like(log_ts, math.log1p(-beta)))  # [N, T]
    per_s = beta * log_ts.exp() * (log_ts - log_ms) - (1.0 - beta) * log_ms  # [N, T] h / s
    return per_s, -(1.0 - beta) * log_ms  # dh/ds = (1 - beta) log(s/m)


@traceable
def gkd_loss(lp: Tensor, sampler_lp: Tensor, teacher_lp: Tensor, mask: Tensor, *, beta: float,
             agg: Callable[[Tensor, Tensor], Tensor] = token_mean) -> tuple[Tensor, Tensor]:
    """GKD's token-level JSD_beta(t || s) from the sampled tokens only (no teacher logits), with
    tokens drawn from q (`sampler_lp`; q = s on-policy). Returns (loss, importance weight mean).

        rho_t = s(y_t) / q(y_t)                                  (detached)
        value  = agg( rho_t h(s, t) / s )                         an unbiased estimate of sum_y h
        grad   = agg( rho_t dh/ds(y_t) grad log s(y_t) )          the gradient of sum_y h, unbiased
        dh/ds  = (1 - beta) log(s / m) (0 < beta < 1),  -t/s (beta = 0),  log(s / t) (beta = 1)

    The loss's value is the divergence estimate and its gradient the one above, as GKD does not
    differentiate through the student's sampling of the prefix. At beta = 1 on-policy the gradient
    is that of on-policy distillation's advantage `distill_advantage` (a test pins it).
    """
    beta = check_beta(beta, "gkd_loss")
    mask = as_mask(mask, "gkd_loss")
    current = lp.detach()  # [N, T]
    rho = torch.where(mask, current - sampler_lp, 0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()  # [N, T]
    per_s, slope = _sampled_terms(current, teacher_lp, beta)  # [N, T], [N, T]
    value = torch.where(mask, rho * per_s, 0.0)  # [N, T]
    weight = torch.where(mask, rho * slope, 0.0)  # [N, T]
    surrogate = value + weight * torch.where(mask, lp - current, 0.0)  # [N, T]: value's number, weight * grad lp
    return agg(surrogate, mask), agg(rho, mask).detach()
