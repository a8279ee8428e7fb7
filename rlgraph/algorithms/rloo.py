"""RLOO (Ahmadian et al., 2024, "Back to Basics", arXiv 2402.14740): leave-one-out group baseline.

    A_i = r_i - 1/(n-1) sum_{j in group, j != i} r_j
    L   = token_mean( max(-A_i rho_it, -A_i clip(rho_it, 1-eps, 1+eps)) )

As verl's `rloo` estimator: the advantage replaces GRPO's, the PPO-clip loss stays.
"""

import rlgraph as rg
from rlgraph import functional as F
from rlgraph.algorithms.hparams import check_hparams
from rlgraph.algorithms.metrics import loss_metrics, rollout_metrics


@rg.algorithm
def rloo(state: rg.State, prompts: rg.Prompts, *, n=4, clip=0.2, temperature=1.0, top_p=1.0, stop=(), max_new_tokens=None,
         epochs=1, micro_batch_size=None):
    check_hparams("rloo", group_estimator="rloo", n=n, clip=clip, max_new_tokens=max_new_tokens, epochs=epochs,
                  micro_batch_size=micro_batch_size)
    ro = rg.generate(state.policy, prompts, n=n, temperature=temperature, top_p=top_p,
                     max_new_tokens=max_new_tokens, stop=stop)  # Rollouts[N, T]
    r = rg.score(state.reward, ro)                                     # [N]
    adv = F.rloo(r, ro.group)[:, None]                                 # [N, 1]

    def loss(lp, entropy):                                             # lp, entropy: [N, T], with gradients
        value, clip_frac, approx_kl = F.ppo_clip(lp, ro.logprobs, adv, ro.mask, clip_low=clip)
        return value, {"clip_frac": clip_frac, "approx_kl": approx_kl, **loss_metrics(lp, ro, entropy)}

    policy = rg.update(state.policy, ro, loss, epochs=epochs, temperature=temperature, micro_batch_size=micro_batch_size)
    return state.replace(policy=policy), rollout_metrics(r, ro)
