"""GSPO (Zheng et al., 2025, "Group Sequence Policy Optimization", arXiv 2507.18071).

GRPO's group advantages with the importance ratio and its clipping taken per *sequence*:

    A_i = (r_i - mean(r_group)) / std(r_group)
    s_i = exp( mean_t (log pi - log pi_old)_it )          (geometric mean of the token ratios)
    L   = mean_i( max(-A_i s_i, -A_i clip(s_i, 1-eps_low, 1+eps_high)) )

The paper's clip range is tiny (3e-4, 4e-4) because s_i is a per-token average.
"""

import rlgraph as rg
from rlgraph import functional as F
from rlgraph.algorithms.hparams import check_hparams
from rlgraph.algorithms.metrics import loss_metrics, rollout_metrics


@rg.algorithm
def gspo(state: rg.State, prompts: rg.Prompts, *, n=8, clip_low=3e-4, clip_high=4e-4, temperature=1.0, top_p=1.0, stop=(),
         max_new_tokens=None, epochs=1, micro_batch_size=None):
    check_hparams("gspo", group_estimator="group_normalize", n=n, clip_low=clip_low, clip_high=clip_high,
                  max_new_tokens=max_new_tokens, epochs=epochs, micro_batch_size=micro_batch_size)
    ro = rg.generate(state.policy, prompts, n=n, temperature=temperature, top_p=top_p,
                     max_new_tokens=max_new_tokens, stop=stop)  # Rollouts[N, T]
    r = rg.score(state.reward, ro)                                     # [N]
    adv = F.group_normalize(r, ro.group)[:, None]                      # [N, 1]

    def loss(lp, entropy):                                             # lp, entropy: [N, T], with gradients
        value, clip_frac, approx_kl = F.gspo(lp, ro.logprobs, adv, ro.mask, clip_low=clip_low, clip_high=clip_high)
        return value, {"clip_frac": clip_frac, "approx_kl": approx_kl, **loss_metrics(lp, ro, entropy)}

    policy = rg.update(state.policy, ro, loss, epochs=epochs, temperature=temperature, micro_batch_size=micro_batch_size)
    return state.replace(policy=policy), rollout_metrics(r, ro)
