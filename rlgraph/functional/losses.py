"""Policy and value losses: PPO-clip, GSPO, CISPO, GPG, Clip-Cov, KL-Cov, clipped value loss, VAPO's
positive-example LM loss.

Conventions shared by every policy loss, so that one can replace another in an algorithm:

    loss, clip_fraction, approx_kl = F.ppo_clip(lp, ro.logprobs, adv[:, None], ro.mask)

- arguments `(lp, old_lp, adv, mask, *, <hyper-parameters>, agg=token_mean)`: current and old
  log-probs f32[N,T], advantages f32[N,1] (per sequence) or f32[N,T], mask bool[N,T];
- `agg` is the loss aggregation *function* (`token_mean`, `seq_mean_token_mean`, ...);
- returns a tuple of three f32[] scalars `(loss, clip_fraction, approx_kl)`: the loss to
  minimise, the fraction of unmasked tokens the method clipped or otherwise intervened on, and
  the k1 estimate of KL(old || new) = token_mean(old_lp - lp). Traced ops return tensors or
  tuples, never dicts. Metrics are detached and aggregated with `token_mean`, so under
  `loss_normalization` they add up over micro-batches exactly like the loss.

Every policy loss is registered by name at the end of this module (`F.get_loss(name)`, `rlgraph
list`), with the names of the metrics it returns after the loss.

Values at masked positions never matter (they may be garbage, inf or NaN). Log-ratios are
clamped to [-20, 20] before `exp` as in verl, so extreme inputs stay finite.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from rlgraph.functional.aggregate import as_mask, masked_mean, seq_mean_token_mean, token_mean
from rlgraph.functional.registry import register_loss
from rlgraph.ir.ops import traceable

Aggregation = Callable[[Tensor, Tensor], Tensor]
LOG_RATIO_CLAMP = 20.0


def _log_ratio(lp: Tensor, old_lp: Tensor, mask: Tensor) -> Tensor:
    """log(pi / pi_old) per token, 0 at masked positions, clamped to +-20 for a finite exp."""
    return torch.where(mask, lp - old_lp, 0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [N, T]


def _metrics(fraction: Tensor, log_ratio: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(clip fraction, approx KL), detached, aggregated like a token-mean loss."""
    clip_fraction = token_mean(fraction.to(log_ratio.dtype), mask).detach()  # []
    return clip_fraction, token_mean(-log_ratio, mask).detach()


def _surrogates(ratio: Tensor, adv: Tensor, clip_low: float, clip_high: float) -> tuple[Tensor, Tensor]:
    """PPO's two per-token losses: (-A r, -A clip(r, 1 - clip_low, 1 + clip_high))."""
    return -adv * ratio, -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # [N, T], [N, T]


def _first_k(scores: Tensor, candidates: Tensor, k: Tensor) -> Tensor:
    """bool mask of the (at most) k candidates with the highest scores; static shapes."""
    flat = torch.where(candidates, scores, -torch.inf).flatten()  # [N*T]
    order = torch.argsort(flat, descending=True, stable=True)  # [N*T]
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))  # [N*T]
    return candidates & (rank < k).view(candidates.shape)  # [N, T]


def _token_budget(fraction: float, mask: Tensor) -> Tensor:
    """max(floor(fraction * unmasked tokens), 1), in float64 like Python's int(fraction * n)."""
    return torch.floor(mask.sum().to(torch.float64) * fraction).clamp(min=1)  # []


@traceable
def ppo_clip(lp: Tensor, old_lp: Tensor, adv: Tensor, mask: Tensor, *, clip_low: float = 0.2,
             clip_high: float | None = None, dual_clip: float | None = None,
             agg: Aggregation = token_mean) -> tuple[Tensor, Tensor, Tensor]:
    """PPO: L_t = max(-A r_t, -A clip(r_t, 1 - clip_low, 1 + clip_high)), r_t = exp(lp - old_lp).

    `clip_high` defaults to `clip_low` (DAPO's clip-higher sets it larger). `dual_clip=c` (> 1)
    bounds the loss of negative-advantage tokens by -c A (arXiv 1912.09729); verl applies it
    always with c = 3, rlgraph only when asked. Source: arXiv 1707.06347; verl
    `compute_policy_loss_vanilla`. Returns (loss, clip_fraction, approx_kl).
    """
    mask = as_mask(mask, "ppo_clip")
    high = clip_low if clip_high is None else clip_high
    log_ratio = _log_ratio(lp, old_lp, mask)  # [N, T]
    adv = torch.where(mask, adv, 0.0)  # [N, T]
    unclipped, clipped = _surrogates(torch.exp(log_ratio), adv, clip_low, high)  # [N, T], [N, T]
    per_token = torch.maximum(unclipped, clipped)  # [N, T]
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"ppo_clip: dual_clip must be > 1, got {dual_clip}")
        per_token = torch.where(adv < 0, torch.minimum(per_token, -adv * dual_clip), per_token)  # [N, T]
    return (agg(per_token, mask), *_metrics(clipped > unclipped, log_ratio, mask))


@traceable
def gspo(lp: Tensor, old_lp: Tensor, adv: Tensor, mask: Tensor, *, clip_low: float = 3e-4,
         clip_high: float = 4e-4, agg: Aggregation = seq_mean_token_mean) -> tuple[Tensor, Tensor, Tensor]:
    """GSPO: PPO-clip on the sequence ratio s_i = exp(mean_t(lp - old_lp)) (a geometric mean).

    Token form s_it = sg(s_i) * pi_t / sg(pi_t), clamped at exp(10): each token gets the
    sequence's clipping decision and its own gradient. Defaults are the paper's (3e-4, 4e-4) and
    its sequence-level aggregation. Source: arXiv 2507.18071; verl `compute_policy_loss_gspo`.
    Returns (loss, clip_fraction, approx_kl).
    """
    mask = as_mask(mask, "gspo")
    lp = torch.where(mask, lp, 0.0)  # [N, T]
    seq_log_ratio = masked_mean(lp - old_lp, mask, dim=-1)  # [N]
    log_ratio = (lp - lp.detach() + seq_log_ratio.detach()[:, None]).clamp(max=10.0)  # [N, T]
    adv = torch.where(mask, adv, 0.0)  # [N, T]
    unclipped, clipped = _surrogates(torch.exp(log_ratio), adv, clip_low, clip_high)  # [N, T], [N, T]
    per_token = torch.maximum(unclipped, clipped)  # [N, T]
    return (agg(per_token, mask), *_metrics(clipped > unclipped, _log_ratio(lp, old_lp, mask), mask))


@traceable
def cispo(lp: Tensor, old_lp: Tensor, adv: Tensor, mask: Tensor, *, clip_low: float = 0.2,
          clip_high: float = 0.2, agg: Aggregation = token_mean) -> tuple[Tensor, Tensor, Tensor]:
    """CISPO: L_t = -sg(clip(r_t, 1 - clip_low, 1 + clip_high)) A lp_t.

    The importance weight is clipped and detached, so clipped tokens keep their gradient through
    lp. The paper uses no lower bound (pass clip_low=1.0). Source: MiniMax-M1, arXiv 2506.13585;
    verl `compute_policy_loss_cispo`. Returns (loss, clip_fraction, approx_kl).
    """
    mask = as_mask(mask, "cispo")
    log_ratio = _log_ratio(lp, old_lp, mask)  # [N, T]
    ratio = torch.exp(log_ratio).detach()  # [N, T]
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # [N, T]
    per_token = -weight * torch.where(mask, adv, 0.0) * torch.where(mask, lp, 0.0)  # [N, T]
    was_clipped = (ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)  # [N, T]
    return (agg(per_token, mask), *_metrics(was_clipped, log_ratio, mask))


@traceable
def gpg_loss(lp: Tensor, old_lp: Tensor, adv: Tensor, mask: Tensor, *,
             agg: Aggregation = token_mean) -> tuple[Tensor, Tensor, Tensor]:
    """GPG: L_t = -A lp_t, plain policy gradient without ratio or clipping (clip_fraction is 0).

    `old_lp` only feeds the approx_kl metric. Source: arXiv 2504.02546; verl
    `compute_policy_loss_gpg`. Returns (loss, clip_fraction, approx_kl).
    """
    mask = as_mask(mask, "gpg_loss")
    per_token = -torch.where(mask, adv, 0.0) * torch.where(mask, lp, 0.0)  # [N, T]
    return (agg(per_token, mask), *_metrics(torch.zeros_like(mask), _log_ratio(lp, old_lp, mask), mask))


def _covariance(adv: Tensor, lp: Tensor, mask: Tensor) -> Tensor:
    """Centred product (A - mean A)(lp - mean lp) over unmasked tokens, detached: f32[N,T]."""
    adv = torch.where(mask, adv, 0.0).detach()  # [N, T]
    lp = torch.where(mask, lp, 0.0).detach()  # [N, T]
    return (adv - masked_mean(adv, mask)) * (lp - masked_mean(lp, mask))  # [N, T]


@traceable
def clip_cov(lp: Tensor, old_lp: Tensor, adv: Tensor, mask: Tensor, *, clip_low: float = 0.2,
             clip_high: float | None = None, cov_ratio: float = 2e-4, cov_low: float = 1.0,
             cov_high: float = 5.0, priority: Tensor | None = None,
             agg: Aggregation = token_mean) -> tuple[Tensor, Tensor, Tensor]:
    """Clip-Cov: PPO-clip, plus the loss of a few high-covariance tokens is zeroed (no gradient).

    Candidates: unmasked tokens PPO did not clip, with cov_low < (A - mean A)(lp - mean lp) <
    cov_high. Of these, max(floor(cov_ratio * tokens), 1) are dropped: the ones with the highest
    `priority` f32[N,T] if given (pass `torch.rand_like(lp)` for the paper's random choice), else
    the highest covariance (deterministic). Statistics and the budget are those of this call's
    batch (as verl, per micro-batch). clip_fraction is the dropped fraction. Source: "The Entropy
    Mechanism of RL for Reasoning LMs", arXiv 2505.22617; verl `compute_policy_loss_clip_cov`.
    """
    mask = as_mask(mask, "clip_cov")
    high = clip_low if clip_high is None else clip_high
    log_ratio = _log_ratio(lp, old_lp, mask)  # [N, T]
    adv = torch.where(mask, adv, 0.0)  # [N, T]
    unclipped, clipped = _surrogates(torch.exp(log_ratio), adv, clip_low, high)  # [N, T], [N, T]
    cov = _covariance(adv, lp, mask)  # [N, T]
    candidates = mask & ~(clipped > unclipped) & (cov > cov_low) & (cov < cov_high)  # [N, T]
    scores = cov if priority is None else priority.detach()  # [N, T]
    dropped = _first_k(scores, candidates, _token_budget(cov_ratio, mask))  # [N, T]
    per_token = torch.where(dropped, 0.0, torch.maximum(unclipped, clipped))  # [N, T]
    return (agg(per_token, mask), *_metrics(dropped, log_ratio, mask))


@traceable
def kl_cov(lp: Tensor, old_lp: Tensor, adv: Tensor, mask: Tensor, *, kl_ratio: float = 2e-4,
           kl_coef: float = 1.0, agg: Aggregation = token_mean) -> tuple[Tensor, Tensor, Tensor]:
    """KL-Cov: L_t = -A r_t (no clipping), + kl_coef |lp_t - old_lp_t| on the top-k covariance tokens.

    k = max(floor(kl_ratio * tokens), 1) unmasked tokens with the largest (A - mean A)(lp - mean
    lp), over this call's batch (as verl, per micro-batch). clip_fraction is the penalised
    fraction; approx_kl is k1 like every loss here (verl reports mean |log-ratio|). Source: arXiv
    2505.22617; verl `compute_policy_loss_kl_cov`.
    """
    mask = as_mask(mask, "kl_cov")
    log_ratio = _log_ratio(lp, old_lp, mask)  # [N, T]
    adv = torch.where(mask, adv, 0.0)  # [N, T]
    penalised = _first_k(_covariance(adv, lp, mask), mask, _token_budget(kl_ratio, mask))  # [N, T]
    per_token = -adv * torch.exp(log_ratio) + torch.where(penalised, kl_coef * log_ratio.abs(), 0.0)  # [N, T]
    return (agg(per_token, mask), *_metrics(penalised, log_ratio, mask))


@traceable
def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *, clip: float | None = 0.5,
               agg: Aggregation = token_mean) -> tuple[Tensor, Tensor]:
    """Clipped value loss: 0.5 agg(max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)).

    `clip=None` is the plain 0.5 agg((V - R)^2). Source: PPO as in TRL/verl `compute_value_loss`
    (verl's default cliprange_value is 0.5). Returns (loss, clip_fraction): the fraction of tokens
    where the clipped term is larger.
    """
    mask = as_mask(mask, "value_loss")
    values = torch.where(mask, values, 0.0)  # [N, T]
    returns = torch.where(mask, returns, 0.0)  # [N, T]
    error = (values - returns).square()  # [N, T]
    if clip is None:
        return 0.5 * agg(error, mask), error.new_zeros(())
    old_values = torch.where(mask, old_values, 0.0)  # [N, T]
    clipped_error = (torch.clamp(values, old_values - clip, old_values + clip) - returns).square()  # [N, T]
    fraction = token_mean((clipped_error > error).to(error.dtype), mask).detach()  # []
    return 0.5 * agg(torch.maximum(error, clipped_error), mask), fraction


@traceable
def entropy_bonus(entropy: Tensor, mask: Tensor, *, agg: Aggregation = token_mean) -> Tensor:
    """agg(entropy, mask): the mean per-token entropy to *subtract* (times a coefficient) from a loss.

    Use the entropy of `rg.logprobs(..., entropy=True)` or `entropy_from_logits`. Source: verl
    `compute_entropy_loss`.
    """
    return agg(entropy, mask)  # []


@traceable
def positive_token_weight(mask: Tensor, positive: Tensor) -> Tensor:
    """f32[]: unmasked tokens / unmasked tokens of the positive rows (>= 1 of them counted), over the batch.

    The factor that turns `token_mean` (which divides by every token of the mini-batch) into a
    mean over the positive rows' tokens; a batch statistic, taken once before the micro-batches.
    """
    mask = as_mask(mask, "positive_token_weight")
    kept = mask & positive.to(torch.bool)[:, None]  # [N, T]
    return mask.sum().to(torch.float32) / kept.sum().clamp(min=1).to(torch.float32)  # []


@traceable
def positive_nll(lp: Tensor, mask: Tensor, positive: Tensor, weight: Tensor) -> Tensor:
    """VAPO's positive-example LM loss: L_NTP = -sum_{i in T} sum_t log pi(y_it) / sum_{i in T} |y_i|.

    T is the set of positive (correct) rows, `positive` bool[N]; `weight` is
    `positive_token_weight(mask, positive)` of the whole batch, so the loss is computed as
    weight * token_mean(-lp [i in T], mask), which micro-batches and data-parallel shards add up
    to exactly (the denominator is the batch's, not a piece's). 0 when no row is positive.
    Source: arXiv 2504.05118 ("Positive Example LM Loss", weighted by mu = 0.1 there).
    """
    mask = as_mask(mask, "positive_nll")
    kept = mask & positive.to(torch.bool)[:, None]  # [N, T]
    return weight * token_mean(torch.where(kept, -lp, 0.0), mask)  # []


# KL estimators the fused policy-loss kernel implements (verl's names and the k-names).
POLICY_LOSS_KL = ("k1", "kl", "k2", "mse", "k3", "low_var_kl")


@traceable
def policy_loss(lp: Tensor, old_lp: Tensor, adv: Tensor, mask: Tensor, *, ref_lp: Tensor | None = None,
                entropy: Tensor | None = None, clip_low: float = 0.2, clip_high: float | None = None,
                dual_clip: float | None = None, kl_coef: float = 0.0, kl_estimator: str = "k3",
                entropy_coef: float = 0.0, agg: Aggregation = token_mean) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """A whole PPO-family policy loss as one op: agg(pg + kl_coef * KL(pi || ref) - entropy_coef * H).

    pg is `ppo_clip`'s per-token loss (asymmetric and dual clip as there), KL one of
    `POLICY_LOSS_KL` between `lp` and `ref_lp` (none without `ref_lp`), H the per-token
    `entropy` (none without it). Aggregation is linear, so this equals `ppo_clip(...)[0] +
    kl_coef * agg(kl) - entropy_coef * entropy_bonus(...)` term by term. One op lets the `fuse`
    pass run the loss, its gradient and every metric in one kernel pass (`fused_policy_loss`).
    Source: verl `compute_policy_loss_vanilla` + `kl_penalty` + `agg_loss` (the actor's loss with
    `use_kl_loss`). Returns (loss, clip_fraction, approx_kl, entropy, kl); the last two are
    detached token means (0 without `entropy` / `ref_lp`).
    """
    if kl_estimator not in POLICY_LOSS_KL:
        raise ValueError(f"policy_loss: kl_estimator must be one of {', '.join(POLICY_LOSS_KL)}, got {kl_estimator!r}; "
                         "for another estimator add `kl_coef * agg(F.kl_abs(lp, ref), mask)` to ppo_clip's loss")
    from rlgraph.functional.kl import KL_ESTIMATORS

    mask = as_mask(mask, "policy_loss")
    value, clip_fraction, approx_kl = ppo_clip(lp, old_lp, adv, mask, clip_low=clip_low, clip_high=clip_high,
                                               dual_clip=dual_clip, agg=agg)
    zero = torch.zeros((), dtype=value.dtype, device=value.device)
    kl_mean = ent_mean = zero
    if ref_lp is not None:
        kl = KL_ESTIMATORS[kl_estimator](torch.where(mask, lp, 0.0), torch.where(mask, ref_lp, 0.0))  # [N, T]
        value = value + kl_coef * agg(kl, mask)
        kl_mean = token_mean(kl, mask).detach()
    if entropy is not None:
        entropy = torch.where(mask, entropy, 0.0)  # [N, T]
        value = value - entropy_coef * agg(entropy, mask)
        ent_mean = token_mean(entropy, mask).detach()
    return value, clip_fraction, approx_kl, ent_mean, kl_mean


# By name, for configs and the CLI: `F.get_loss(name)(lp, old_lp, adv, mask, **hparams)` -> (loss, *metrics),
# the metrics named as algorithms report them. clip_frac is what each loss clipped or intervened on:
# the clipped tokens (ppo_clip, gspo: whole sequences, cispo: clipped weights, policy_loss), the zeroed
# tokens (clip_cov), the penalised tokens (kl_cov), always 0 (gpg_loss).
register_loss("ppo_clip", ppo_clip)
register_loss("gspo", gspo)
register_loss("cispo", cispo)
register_loss("gpg_loss", gpg_loss)
register_loss("clip_cov", clip_cov)
register_loss("kl_cov", kl_cov)
register_loss("policy_loss", policy_loss, metrics=("clip_frac", "approx_kl", "entropy", "kl"))
