"""Dr.GRPO (Liu et al., 2025, "Understanding R1-Zero-Like Training", arXiv 2503.20783).

GRPO without its two length/difficulty biases: no division by the group std, and a constant
normaliser in place of each response's length.

    A_i = r_i - mean(r_group)
    L   = sum_{i,t} max(-A_i rho_it, -A_i clip(rho_it, 1-eps_low, 1+eps_high)) / (G * T_max)
"""

import rlgraph as rg
from rlgraph import functional as F
from rlgraph.algorithms.hparams import check_hparams
from rlgraph.algorithms.metrics import loss_metrics, rollout_metrics


@rg.algorithm
def dr_grpo(state: rg.State, prompts: rg.Prompts, *, n=8, clip=0.2, clip_high=None, temperature=1.0, top_p=1.0, stop=(),
            max_new_tokens=None, epochs=1, micro_batch_size=None):
    check_hparams("dr_grpo", group_estimator="group_normalize", n=n, clip=clip, clip_high=clip_high,
                  max_new_tokens=max_new_tokens, epochs=epochs, micro_batch_size=micro_batch_size)
    ro = rg.generate(state.policy, prompts, n=n, temperature=temperature, top_p=top_p,
                     max_new_tokens=max_new_tokens, stop=stop)  # Rollouts[N, T]
    r = rg.score(state.reward, ro)                                     # [N]
    adv = F.group_normalize(r, ro.group, scale=False)[:, None]         # [N, 1]

    def loss(lp, entropy):                                             # lp, entropy: [N, T], with gradients
        value, clip_frac, approx_kl = F.ppo_clip(lp, ro.logprobs, adv, ro.mask, clip_low=clip, clip_high=clip_high,
                                                 agg=F.seq_mean_token_sum_norm)
        return value, {"clip_frac": clip_frac, "approx_kl": approx_kl, **loss_metrics(lp, ro, entropy)}

    policy = rg.update(state.policy, ro, loss, epochs=epochs, temperature=temperature, micro_batch_size=micro_batch_size)
    return state.replace(policy=policy), rollout_metrics(r, ro)
