"""DAPO (Yu et al., 2025, arXiv 2503.14476): dynamic sampling, clip-higher, token-level loss,
soft overlong punishment.

    keep groups with 0 < acc < 1; refill from fresh prompts until B groups   (dynamic sampling)
    r'_i = r_i + R_len(|y_i|),  R_len = clamp(((L_max - L_cache) - |y|) / L_cache, -1, 0)   (overlong shaping)
    A_i  = (r'_i - mean(r'_group)) / std(r'_group)
    L    = token_mean( max(-A rho, -A clip(rho, 1-eps_low, 1+eps_high)) ),  eps_high > eps_low  (clip-higher)

Dynamic sampling filters on the verifier's reward, as the paper does; the refill loop (generate +
score + the keep test on fresh prompts) is `rg.filter_groups`, printed in the plan as a loop.
"""

import torch
from torch import Tensor

import rlgraph as rg
from rlgraph import functional as F
from rlgraph.algorithms.hparams import check_hparams
from rlgraph.algorithms.metrics import loss_metrics, rollout_metrics
from rlgraph.ir.ops import traceable


@traceable
def overlong_penalty(mask: Tensor, *, max_length: int, buffer: int) -> Tensor:
    """DAPO's soft overlong punishment f32[N]: 0 up to max_length - buffer tokens, then linear to -1."""
    length = mask.to(torch.bool).sum(dim=-1).to(torch.float32)  # [N]
    return ((max_length - buffer - length) / buffer).clamp(-1.0, 0.0)  # [N]


def check_overlong_buffer(max_new_tokens: int | None, buffer: int, coef: float) -> None:
    """Refuse a buffer over half the budget: the punishment would start before half of max_new_tokens
    (the default buffer 4 with max_new_tokens=5 punishes from the first token: nearly every response,
    silently). Refused rather than scaled: a scaled buffer would be a hyper-parameter nobody set.
    DAPO's own setting is 4096 of 20480 (a fifth)."""
    if coef == 0 or max_new_tokens is None or 2 * buffer <= max_new_tokens:
        return
    import sys

    from rlgraph.errors import TraceError, user_location

    start = max_new_tokens - buffer
    error = TraceError(f"dapo: overlong_buffer={buffer} covers {min(buffer, max_new_tokens)} of max_new_tokens="
                       f"{max_new_tokens}: the soft overlong punishment starts after {max(start, 0)} token(s), so almost "
                       "every response is punished for its length", user_location(sys._getframe(1)),
                       fix=f"pass overlong_buffer <= {max_new_tokens // 2} (at most half of max_new_tokens; DAPO uses a "
                           "fifth: 4096 of 20480), a larger max_new_tokens, or overlong_coef=0 to switch it off")
    error.hparam = "overlong_buffer"
    raise error


@rg.algorithm
def dapo(state: rg.State, prompts: rg.Prompts, *, n=8, clip_low=0.2, clip_high=0.28, max_new_tokens=20,
         overlong_buffer=4, overlong_coef=1.0, dynamic_sampling=True, max_rounds=4, temperature=1.0, top_p=1.0, stop=(), epochs=1,
         micro_batch_size=None):
    check_hparams("dapo", group_estimator="group_normalize", n=n, clip_low=clip_low, clip_high=clip_high,
                  max_new_tokens=max_new_tokens, overlong_buffer=overlong_buffer, max_rounds=max_rounds, epochs=epochs,
                  micro_batch_size=micro_batch_size)
    check_overlong_buffer(max_new_tokens, overlong_buffer, overlong_coef)
    ro = rg.generate(state.policy, prompts, n=n, temperature=temperature, top_p=top_p,
                     max_new_tokens=max_new_tokens, stop=stop)  # Rollouts[N, T]
    r = rg.score(state.reward, ro)                                     # [N]
    if dynamic_sampling:                                               # a hyper-parameter, not a traced value
        ro, r = rg.filter_groups(ro, r, F.group_has_variance(r, ro.group), max_rounds=max_rounds)  # [N]: B groups kept
    shaped = r + overlong_coef * overlong_penalty(ro.mask, max_length=max_new_tokens, buffer=overlong_buffer)  # [N]
    adv = F.group_normalize(shaped, ro.group)[:, None]                 # [N, 1]

    def loss(lp, entropy):                                             # lp, entropy: [N, T], with gradients
        value, clip_frac, approx_kl = F.ppo_clip(lp, ro.logprobs, adv, ro.mask, clip_low=clip_low,
                                                 clip_high=clip_high, agg=F.token_mean)
        return value, {"clip_frac": clip_frac, "approx_kl": approx_kl, **loss_metrics(lp, ro, entropy)}

    policy = rg.update(state.policy, ro, loss, epochs=epochs, temperature=temperature, micro_batch_size=micro_batch_size)
    return state.replace(policy=policy), {**rollout_metrics(r, ro), "shaped_reward": shaped.mean()}
