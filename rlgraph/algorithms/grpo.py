"""GRPO (Shao et al., 2024, DeepSeekMath): group-normalised rewards as advantages, PPO-clip loss.

    A_i = (r_i - mean(r_group)) / (std(r_group) + eps)
    L   = token_mean( -min(rho * A, clip(rho, 1-eps_low, 1+eps_high) * A) + beta * KL_k3(pi || pi_ref) )
"""

import rlgraph as rg
from rlgraph import functional as F


@rg.algorithm
def grpo(state: rg.State, prompts: rg.Prompts, *, n=8, clip=0.2, clip_high=None, kl=0.0, temperature=1.0,
         max_new_tokens=None, epochs=1, micro_batch_size=None):
    ro = rg.generate(state.policy, prompts, n=n, temperature=temperature, max_new_tokens=max_new_tokens)  # Rollouts[N, T]
    r = rg.score(state.reward, ro)                                     # [N]
    adv = F.group_normalize(r, ro.group)[:, None]                      # [N, 1]
    ref = rg.logprobs(state.ref, ro, temperature=temperature) if kl else None  # [N, T]
    high = clip if clip_high is None else clip_high

    def loss(lp):                                                      # lp: [N, T], with gradients
        surrogate, clip_frac, approx_kl = F.ppo_clip(lp, ro.logprobs, adv, ro.mask, clip_low=clip, clip_high=high)
        total = surrogate + kl * F.token_mean(F.kl_k3(lp, ref), ro.mask) if kl else surrogate  # []
        return total, {"clip_frac": clip_frac, "approx_kl": approx_kl}

    policy = rg.update(state.policy, ro, loss, epochs=epochs, temperature=temperature, micro_batch_size=micro_batch_size)
    return state.replace(policy=policy), {"reward": r.mean()}
