"""CISPO (MiniMax-M1, 2025, arXiv 2506.13585): clip the importance weight, not the update.

    A_i  = (r_i - mean(r_group)) / std(r_group)
    L    = token_mean( -sg(clip(rho_it, 1-eps_low, 1+eps_high)) A_i log pi_it )

The weight is detached, so every token keeps its gradient (PPO drops clipped tokens). The paper
sets no lower bound: the default `clip_low=1.0` clamps rho at 0, i.e. never.
"""

import rlgraph as rg
from rlgraph import functional as F
from rlgraph.algorithms.hparams import check_hparams
from rlgraph.algorithms.metrics import loss_metrics, rollout_metrics


@rg.algorithm
def cispo(state: rg.State, prompts: rg.Prompts, *, n=8, clip_low=1.0, clip_high=0.2, temperature=1.0, top_p=1.0, stop=(),
          max_new_tokens=None, epochs=1, micro_batch_size=None):
    check_hparams("cispo", group_estimator="group_normalize", n=n, clip_low=clip_low, clip_high=clip_high,
                  max_new_tokens=max_new_tokens, epochs=epochs, micro_batch_size=micro_batch_size)
    ro = rg.generate(state.policy, prompts, n=n, temperature=temperature, top_p=top_p,
                     max_new_tokens=max_new_tokens, stop=stop)  # Rollouts[N, T]
    r = rg.score(state.reward, ro)                                     # [N]
    adv = F.group_normalize(r, ro.group)[:, None]                      # [N, 1]

    def loss(lp, entropy):                                             # lp, entropy: [N, T], with gradients
        value, clip_frac, approx_kl = F.cispo(lp, ro.logprobs, adv, ro.mask, clip_low=clip_low, clip_high=clip_high)
        return value, {"clip_frac": clip_frac, "approx_kl": approx_kl, **loss_metrics(lp, ro, entropy)}

    policy = rg.update(state.policy, ro, loss, epochs=epochs, temperature=temperature, micro_batch_size=micro_batch_size)
    return state.replace(policy=policy), rollout_metrics(r, ro)
