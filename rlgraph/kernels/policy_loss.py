"""The PPO policy-loss family, forward and backward in one fused pass over [N, T].

Per unmasked token, with r = exp(clamp(lp - old_lp, -20, 20)) and advantage A:

    pg    = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))
    pg    = min(pg, -A c)                      if dual_clip = c and A < 0   (arXiv 1912.09729)
    L_t   = pg + kl_coef * kl(lp, ref_lp) - entropy_coef * entropy
    loss  = sum_t w_t L_t

kl is verl's estimator: k1 = lp - ref; k2 = 0.5 (lp - ref)^2 ("mse"); k3 = exp(x) - x - 1 with
x = clamp(ref - lp, -20, 20) and the result clamped to [-10, 10] ("low_var_kl"). The weight w_t of
a token comes from the aggregation and the *given* counts of the whole mini-batch, so that the
losses of micro-batches add up to the mini-batch loss:

    token-mean               w = 1 / tokens
    seq-mean-token-sum       w = 1 / sequences
    seq-mean-token-mean      w = 1 / (sequences * row_tokens)      (a row is never split)
    seq-mean-token-sum-norm  w = 1 / (sequences * horizon)         (horizon defaults to T)

Without counts, the local ones of `mask` are used (each at least 1), as `rlgraph.functional`
does outside `loss_normalization`. The formulas, clamps and tie-breaking of the gradient are
those of `rlgraph.functional.ppo_clip` + `kl_k1/k2/k3` + `entropy_bonus`, which follow verl
`core_algos` (`compute_policy_loss_vanilla`, `kl_penalty`, `agg_loss`). Metrics (detached,
token means over `tokens`): clip fraction (share of tokens where the clipped term is larger),
approx KL = mean(-log r), mean entropy, mean kl. Values at masked positions never matter.

The Triton kernel computes the loss, the metrics and dloss/dlp (and dloss/dentropy) in one read of
the inputs; backward only scales the saved gradient by the incoming scalar.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

LOG_RATIO_CLAMP = 20.0  # verl clamps lp - old_lp (and ref - lp in k3) to +-20 before exp
KL_VALUE_CLAMP = 10.0  # verl clamps the k3 value to +-10
AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS = {"k1": 1, "kl": 1, "k2": 2, "mse": 2, "k3": 3, "low_var_kl": 3}


class PolicyLoss(NamedTuple):
    """The loss (differentiable, f32[]) and its metrics (detached f32[])."""

    loss: Tensor
    clip_fraction: Tensor
    approx_kl: Tensor
    entropy: Tensor
    kl: Tensor


def aggregation_name(agg) -> str:
    """'token-mean', ... from a verl string, an underscore name or a function such as `token_mean`."""
    name = getattr(agg, "__name__", agg)
    name = name.replace("_", "-") if isinstance(name, str) else name
    if name not in AGGREGATIONS:
        raise ValueError(f"policy_loss: unknown aggregation {agg!r}; use one of {', '.join(AGGREGATIONS)} "
                         "(or the rlgraph.functional function of that name)")
    return name


def unsupported_call(args: tuple, kwargs: dict) -> str | None:
    """Why the fused loss cannot run this traced call (an aggregation it does not implement), or None."""
    agg = kwargs.get("agg", "token-mean")
    try:
        aggregation_name(agg)
    except ValueError:
        return f"aggregation {getattr(agg, '__name__', agg)!r} is not one the kernel implements"
    return None


def _check(lp: Tensor, old_lp: Tensor, adv: Tensor, mask: Tensor, dual_clip: float | None, kl_estimator: str) -> None:
    if lp.dim() != 2 or old_lp.shape != lp.shape or mask.shape != lp.shape:
        raise ValueError(f"policy_loss: lp, old_lp and mask must share one shape [N, T]; got {tuple(lp.shape)}, "
                         f"{tuple(old_lp.shape)}, {tuple(mask.shape)}")
    if adv.shape not in (lp.shape, lp.shape[:1], (lp.shape[0], 1)):
        raise ValueError(f"policy_loss: adv must be [N], [N, 1] or [N, T] for lp {tuple(lp.shape)}; "
                         f"got {tuple(adv.shape)}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"policy_loss: dual_clip must be > 1, got {dual_clip}")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"policy_loss: unknown kl_estimator {kl_estimator!r}; use one of {', '.join(KL_ESTIMATORS)}")


def _counts(mask: Tensor, tokens, sequences, horizon) -> Tensor:
    """f32[3] (tokens, sequences, horizon), each at least 1; local counts where not given."""
    mask = mask.to(torch.bool)
    local = (mask.sum(), mask.any(dim=-1).sum(), mask.shape[-1])
    given = (tokens, sequences, horizon)
    values = [torch.as_tensor(g if g is not None else l, dtype=torch.float32, device=mask.device).reshape(())
              for g, l in zip(given, local)]
    return torch.stack(values).clamp(min=1.0)  # [3]


def _token_weights(mask: Tensor, counts: Tensor, agg: str) -> Tensor:
    """w [N, T]: each unmasked token's share of the aggregated loss (0 where masked)."""
    tokens, sequences, horizon = counts.unbind()
    if agg == "token-mean":
        scale = 1.0 / tokens
    elif agg == "seq-mean-token-sum":
        scale = 1.0 / sequences
    elif agg == "seq-mean-token-mean":
        scale = 1.0 / (sequences * mask.sum(-1, keepdim=True).clamp(min=1))  # [N, 1]
    else:
        scale = 1.0 / (sequences * horizon)
    return torch.where(mask, scale, 0.0)  # [N, T]


# ----------------------------------------------------------------------------- reference


def kl_penalty_reference(lp: Tensor, ref_lp: Tensor, estimator: str) -> Tensor:
    """Per-token KL(pi || ref) estimate [N, T] (verl `kl_penalty`)."""
    kind = KL_ESTIMATORS[estimator]
    if kind == 1:
        return lp - ref_lp
    if kind == 2:
        return 0.5 * (lp - ref_lp).square()
    log_ratio = (ref_lp - lp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [N, T]
    return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(-KL_VALUE_CLAMP, KL_VALUE_CLAMP)


def policy_loss_reference(lp: Tensor, old_lp: Tensor, adv: Tensor, mask: Tensor, *, ref_lp: Tensor | None = None,
                          entropy: Tensor | None = None, clip_low: float = 0.2, clip_high: float | None = None,
                          dual_clip: float | None = None, kl_coef: float = 0.0, kl_estimator: str = "k3",
                          entropy_coef: float = 0.0, agg="token-mean", tokens=None, sequences=None,
                          horizon=None) -> PolicyLoss:
    """Plain torch (autograd) oracle of `policy_loss`; same arguments and result."""
    _check(lp, old_lp, adv, mask, dual_clip, kl_estimator)
    mask = mask.to(torch.bool)
    counts = _counts(mask, tokens, sequences, horizon)  # [3]
    weights = _token_weights(mask, counts, aggregation_name(agg))  # [N, T]
    high = clip_low if clip_high is None else clip_high
    # Masked positions may hold inf/NaN: replace them before any math so no NaN reaches a gradient.
    lp, old_lp = torch.where(mask, lp, 0.0), torch.where(mask, old_lp, 0.0)  # [N, T]
    ref_lp = None if ref_lp is None else torch.where(mask, ref_lp, 0.0)  # [N, T]
    entropy = None if entropy is None else torch.where(mask, entropy, 0.0)  # [N, T]
    log_ratio = (lp - old_lp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [N, T]
    ratio = torch.exp(log_ratio)  # [N, T]
    adv = torch.where(mask, adv if adv.dim() == 2 else adv[:, None], 0.0)  # [N, T]
    unclipped, clipped = -adv * ratio, -adv * ratio.clamp(1.0 - clip_low, 1.0 + high)  # [N, T]
    per_token = torch.maximum(unclipped, clipped)  # [N, T]
    if dual_clip is not None:
        per_token = torch.where(adv < 0, torch.minimum(per_token, -adv * dual_clip), per_token)  # [N, T]
    zero = torch.zeros_like(per_token)
    kl = kl_penalty_reference(lp, ref_lp, kl_estimator) if ref_lp is not None else zero  # [N, T]
    ent = entropy if entropy is not None else zero  # [N, T]
    per_token = per_token + kl_coef * kl - entropy_coef * ent  # [N, T]

    def token_mean(values: Tensor) -> Tensor:
        return (torch.where(mask, values, 0.0).sum() / counts[0]).detach()

    return PolicyLoss(torch.where(mask, weights * per_token, 0.0).sum(), token_mean((clipped > unclipped).float()),
                      token_mean(-log_ratio), token_mean(ent), token_mean(kl))


# ----------------------------------------------------------------------------- triton

if triton is not None:

    @triton.jit
    def _tie_split(a, b):
        """d max(a, b) / d a as torch computes it: 1 if a > b, 1/2 on a tie, else 0."""
        return tl.where(a > b, 1.0, tl.where(a == b, 0.5, 0.0))

    @triton.jit
    def _kl_and_grad(lp, ref, KL: tl.constexpr):
        """(kl, dkl/dlp) per token for estimator KL (1: k1, 2: k2, 3: k3)."""
        if KL == 1:
            return lp - ref, tl.full(lp.shape, 1.0, tl.float32)
        elif KL == 2:
            return 0.5 * (lp - ref) * (lp - ref), lp - ref
        else:
            raw = ref - lp
            x = tl.minimum(tl.maximum(raw, -20.0), 20.0)
            value = tl.exp(x) - x - 1.0
            kl = tl.minimum(tl.maximum(value, -10.0), 10.0)
            active = (raw >= -20.0) & (raw <= 20.0) & (value >= -10.0) & (value <= 10.0)
            return kl, tl.where(active, 1.0 - tl.exp(x), 0.0)

    @triton.jit
    def _ppo_token(lp, old, adv, m, clip_low, clip_high, dual_clip, DUAL: tl.constexpr):
        """Per token: (PPO loss, its d/dlp, clipped?, clamped log-ratio); adv is 0 where masked."""
        raw = tl.where(m, lp - old, 0.0)
        log_ratio = tl.minimum(tl.maximum(raw, -20.0), 20.0)
        ratio = tl.exp(log_ratio)
        unclipped = -adv * ratio
        clipped = -adv * tl.minimum(tl.maximum(ratio, 1.0 - clip_low), 1.0 + clip_high)
        in_band = (ratio >= 1.0 - clip_low) & (ratio <= 1.0 + clip_high)
        g_unclipped = _tie_split(unclipped, clipped)
        per_token = tl.maximum(unclipped, clipped)
        d_ratio = -adv * (g_unclipped + (1.0 - g_unclipped) * in_band.to(tl.float32))
        if DUAL:
            floor = -adv * dual_clip
            use = adv < 0
            d_ratio = tl.where(use, d_ratio * _tie_split(floor, per_token), d_ratio)
            per_token = tl.where(use, tl.minimum(per_token, floor), per_token)
        d_lp = d_ratio * ratio * ((raw >= -20.0) & (raw <= 20.0)).to(tl.float32)
        return per_token, d_lp, clipped > unclipped, log_ratio

    @triton.jit
    def _row_weights(mask_ptr, counts_ptr, rows, row_ok, T, AGG: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_T: tl.constexpr):
        """Each row's token weight w for aggregation AGG (index into AGGREGATIONS) and the counts."""
        tokens = tl.load(counts_ptr)
        sequences = tl.load(counts_ptr + 1)
        horizon = tl.load(counts_ptr + 2)
        row_len = tl.zeros((BLOCK_N,), dtype=tl.float32)
        if AGG == 2:  # seq-mean-token-mean needs each row's token count first
            for t0 in range(0, T, BLOCK_T):
                cols = t0 + tl.arange(0, BLOCK_T)
                ok = row_ok[:, None] & (cols[None, :] < T)
                m = tl.load(mask_ptr + rows[:, None] * T + cols[None, :], mask=ok, other=0)
                row_len += tl.sum((m != 0).to(tl.float32), axis=1)
        if AGG == 0:
            row_w = tl.full((BLOCK_N,), 1.0, tl.float32) / tokens
        elif AGG == 1:
            row_w = tl.full((BLOCK_N,), 1.0, tl.float32) / sequences
        elif AGG == 2:
            row_w = 1.0 / (sequences * tl.maximum(row_len, 1.0))
        else:
            row_w = tl.full((BLOCK_N,), 1.0, tl.float32) / (sequences * horizon)
        return row_w

    @triton.jit
    def _policy_loss_kernel(lp_ptr, old_ptr, adv_ptr, mask_ptr, ref_ptr, ent_ptr, counts_ptr, grad_lp_ptr,
                            grad_ent_ptr, partial_ptr, N, T, stride_adv_n, stride_adv_t, clip_low, clip_high,
                            dual_clip, kl_coef, entropy_coef, AGG: tl.constexpr, KL: tl.constexpr,
                            DUAL: tl.constexpr, HAS_ENT: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_T: tl.constexpr):
        """BLOCK_N rows: loss partial sums, metric sums and dloss/dlp (dloss/dentropy) per token."""
        pid = tl.program_id(0)
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        row_ok = rows < N
        row_w = _row_weights(mask_ptr, counts_ptr, rows, row_ok, T, AGG, BLOCK_N, BLOCK_T)  # [BLOCK_N]
        sums = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)  # loss
        clipped_sum = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
        neg_lr_sum = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
        ent_sum = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
        kl_sum = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
        for t0 in range(0, T, BLOCK_T):
            cols = t0 + tl.arange(0, BLOCK_T)  # [BLOCK_T]
            ok = row_ok[:, None] & (cols[None, :] < T)
            offs = rows[:, None] * T + cols[None, :]  # [BLOCK_N, BLOCK_T]
            m = (tl.load(mask_ptr + offs, mask=ok, other=0) != 0) & ok
            lp = tl.load(lp_ptr + offs, mask=ok, other=0.0).to(tl.float32)
            old = tl.load(old_ptr + offs, mask=ok, other=0.0).to(tl.float32)
            adv = tl.load(adv_ptr + rows[:, None] * stride_adv_n + cols[None, :] * stride_adv_t, mask=ok, other=0.0)
            adv = tl.where(m, adv.to(tl.float32), 0.0)
            per_token, d_lp, clipped, log_ratio = _ppo_token(lp, old, adv, m, clip_low, clip_high, dual_clip, DUAL)
            if KL != 0:
                ref = tl.load(ref_ptr + offs, mask=ok, other=0.0).to(tl.float32)
                kl, d_kl = _kl_and_grad(lp, ref, KL)
                kl = tl.where(m, kl, 0.0)
                per_token += kl_coef * kl
                d_lp += kl_coef * d_kl
                kl_sum += kl
            w = tl.where(m, row_w[:, None], 0.0)  # [BLOCK_N, BLOCK_T]
            if HAS_ENT:
                ent = tl.where(m, tl.load(ent_ptr + offs, mask=ok, other=0.0).to(tl.float32), 0.0)
                per_token -= entropy_coef * ent
                ent_sum += ent
                tl.store(grad_ent_ptr + offs, -entropy_coef * w, mask=ok)
            sums += tl.where(m, w * per_token, 0.0)
            clipped_sum += tl.where(m & clipped, 1.0, 0.0)
            neg_lr_sum += -log_ratio
            tl.store(grad_lp_ptr + offs, tl.where(m, w * d_lp, 0.0), mask=ok)
        out = partial_ptr + pid * 5
        tl.store(out, tl.sum(tl.sum(sums, axis=1), axis=0))
        tl.store(out + 1, tl.sum(tl.sum(clipped_sum, axis=1), axis=0))
        tl.store(out + 2, tl.sum(tl.sum(neg_lr_sum, axis=1), axis=0))
        tl.store(out + 3, tl.sum(tl.sum(ent_sum, axis=1), axis=0))
        tl.store(out + 4, tl.sum(tl.sum(kl_sum, axis=1), axis=0))


class _FusedPolicyLoss(torch.autograd.Function):
    """Forward runs the fused kernel (loss + metrics + per-token gradients); backward scales them."""

    @staticmethod
    def forward(ctx, lp, entropy, old_lp, adv, mask, ref_lp, counts, config):
        N, T = lp.shape
        block_n, block_t = (4, 16) if lp.device.type == "cpu" else (8, 128)
        grid = (triton.cdiv(N, block_n),)
        grad_lp = torch.empty_like(lp, dtype=torch.float32)  # [N, T]
        grad_ent = torch.empty_like(grad_lp) if entropy is not None else grad_lp
        partial = torch.zeros(max(grid[0], 1), 5, dtype=torch.float32, device=lp.device)
        adv2 = adv if adv.dim() == 2 else adv[:, None]  # [N, 1] or [N, T]
        adv_stride_t = adv2.stride(1) if adv2.shape[1] == T and T > 1 else 0
        if N and T:
            _policy_loss_kernel[grid](
                lp, old_lp, adv2, mask, ref_lp if ref_lp is not None else lp,
                entropy if entropy is not None else lp, counts, grad_lp, grad_ent, partial, N, T,
                adv2.stride(0), adv_stride_t, config["clip_low"], config["clip_high"], config["dual_clip"],
                config["kl_coef"], config["entropy_coef"], AGG=config["agg"], KL=config["kl"],
                DUAL=config["dual"], HAS_ENT=entropy is not None, BLOCK_N=block_n, BLOCK_T=block_t)
        sums = partial.sum(0)  # [5]
        ctx.save_for_backward(grad_lp, grad_ent if entropy is not None else None)
        metrics = sums[1:] / counts[0]  # [4]: clip fraction, approx kl, entropy, kl
        ctx.mark_non_differentiable(metrics)
        return sums[0], metrics

    @staticmethod
    def backward(ctx, grad_loss, _grad_metrics):
        grad_lp, grad_ent = ctx.saved_tensors
        return (grad_lp * grad_loss, None if grad_ent is None else grad_ent * grad_loss,
                None, None, None, None, None, None)


def policy_loss_triton(lp: Tensor, old_lp: Tensor, adv: Tensor, mask: Tensor, *, ref_lp: Tensor | None = None,
                       entropy: Tensor | None = None, clip_low: float = 0.2, clip_high: float | None = None,
                       dual_clip: float | None = None, kl_coef: float = 0.0, kl_estimator: str = "k3",
                       entropy_coef: float = 0.0, agg="token-mean", tokens=None, sequences=None,
                       horizon=None) -> PolicyLoss:
    """The fused Triton policy loss (CUDA, or CPU under TRITON_INTERPRET=1); see `policy_loss`."""
    if triton is None:
        raise RuntimeError("policy_loss_triton: triton is not installed; use policy_loss_reference")
    _check(lp, old_lp, adv, mask, dual_clip, kl_estimator)
    mask = mask.to(torch.bool)
    config = dict(clip_low=float(clip_low), clip_high=float(clip_low if clip_high is None else clip_high),
                  dual_clip=float(dual_clip or 0.0), dual=dual_clip is not None, kl_coef=float(kl_coef),
                  entropy_coef=float(entropy_coef), agg=AGGREGATIONS.index(aggregation_name(agg)),
                  kl=KL_ESTIMATORS[kl_estimator] if ref_lp is not None else 0)
    contiguous = [t.contiguous() if t is not None else None
                  for t in (lp, entropy, old_lp, adv, mask.view(torch.uint8), ref_lp)]
    loss, metrics = _FusedPolicyLoss.apply(*contiguous, _counts(mask, tokens, sequences, horizon), config)
    clip_fraction, approx_kl, mean_entropy, mean_kl = metrics.unbind()
    return PolicyLoss(loss, clip_fraction, approx_kl, mean_entropy, mean_kl)


def policy_loss(lp: Tensor, old_lp: Tensor, adv: Tensor, mask: Tensor, **options) -> PolicyLoss:
    """PPO-family policy loss (see the module docstring) with its metrics: Triton on CUDA, torch elsewhere.

    lp f32[N,T] (with grad), old_lp f32[N,T], adv f32[N] / [N,1] / [N,T], mask bool[N,T]; options:
    ref_lp, entropy (f32[N,T]; a gradient flows to it if it requires one), clip_low, clip_high,
    dual_clip, kl_coef, kl_estimator ('k1', 'k2'/'mse', 'k3'/'low_var_kl'), entropy_coef, agg, and
    the global counts tokens, sequences, horizon of the whole mini-batch.
    """
    impl = policy_loss_triton if lp.is_cuda and triton is not None else policy_loss_reference
    return impl(lp, old_lp, adv, mask, **options)


def ppo_clip_fused(lp: Tensor, old_lp: Tensor, adv: Tensor, mask: Tensor, *, clip_low: float = 0.2,
                   clip_high: float | None = None, dual_clip: float | None = None, agg="token-mean",
                   tokens=None, sequences=None, horizon=None, impl=None) -> tuple[Tensor, Tensor, Tensor]:
    """`rlgraph.functional.ppo_clip`'s signature and result (loss, clip_fraction, approx_kl), fused.

    The caller passes the global counts (the executor reads them from `loss_normalization`).
    """
    out = (impl or policy_loss)(lp, old_lp, adv, mask, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip,
                                agg=agg, tokens=tokens, sequences=sequences, horizon=horizon)
    return out.loss, out.clip_fraction, out.approx_kl


def ppo_clip_reference(lp: Tensor, old_lp: Tensor, adv: Tensor, mask: Tensor,
                       **options) -> tuple[Tensor, Tensor, Tensor]:
    """`ppo_clip_fused` on the torch reference (the registry's CPU path)."""
    return ppo_clip_fused(lp, old_lp, adv, mask, impl=policy_loss_reference, **options)


def ppo_clip_triton(lp: Tensor, old_lp: Tensor, adv: Tensor, mask: Tensor,
                    **options) -> tuple[Tensor, Tensor, Tensor]:
    """`ppo_clip_fused` on the Triton kernel."""
    return ppo_clip_fused(lp, old_lp, adv, mask, impl=policy_loss_triton, **options)
