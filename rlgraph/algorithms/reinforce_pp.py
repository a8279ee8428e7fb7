"""REINFORCE++ (Hu, 2025, arXiv 2501.03262): critic-free PPO with batch-whitened returns.

`reinforce_pp`: the KL to the reference is a per-token reward, returns are whitened over the batch.

    r_it = r_i [t = last] - beta (log pi_old - log pi_ref)_it
    A_it = whiten_batch( sum_{t' >= t} gamma^{t'-t} r_it' )
    L    = token_mean( max(-A rho, -A clip(rho, 1-eps, 1+eps)) )

`reinforce_pp_baseline` (the paper's variant for groups, verl `reinforce_plus_plus_baseline`):
the group mean is subtracted before whitening and the KL moves to the loss as k3.

    A_i = whiten_batch( r_i - mean(r_group) )
    L   = token_mean( max(-A rho, -A clip(rho, 1-eps, 1+eps)) + beta KL_k3(pi || pi_ref) )
"""

import rlgraph as rg
from rlgraph import functional as F
from rlgraph.algorithms.hparams import check_hparams
from rlgraph.algorithms.metrics import loss_metrics, rollout_metrics
from rlgraph.algorithms.shaping import kl_penalized_token_rewards


@rg.algorithm
def reinforce_pp(state: rg.State, prompts: rg.Prompts, *, n=1, clip=0.2, kl=0.0, gamma=1.0, temperature=1.0, top_p=1.0, stop=(),
                 max_new_tokens=None, epochs=1, micro_batch_size=None):
    check_hparams("reinforce_pp", n=n, clip=clip, kl=kl, gamma=gamma, max_new_tokens=max_new_tokens, epochs=epochs,
                  micro_batch_size=micro_batch_size)
    ro = rg.generate(state.policy, prompts, n=n, temperature=temperature, top_p=top_p,
                     max_new_tokens=max_new_tokens, stop=stop)  # Rollouts[N, T]
    r = rg.score(state.reward, ro)                                     # [N]
    token_rewards, kl_metrics = kl_penalized_token_rewards(state, ro, r, kl=kl, temperature=temperature)  # [N, T]
    adv = F.reinforce_pp(token_rewards, ro.mask, gamma=gamma)          # [N, T]

    def loss(lp, entropy):                                             # lp, entropy: [N, T], with gradients
        value, clip_frac, approx_kl = F.ppo_clip(lp, ro.logprobs, adv, ro.mask, clip_low=clip)
        return value, {"clip_frac": clip_frac, "approx_kl": approx_kl, **loss_metrics(lp, ro, entropy)}

    policy = rg.update(state.policy, ro, loss, epochs=epochs, temperature=temperature, micro_batch_size=micro_batch_size)
    return state.replace(policy=policy), {**rollout_metrics(r, ro), **kl_metrics}


@rg.algorithm
def reinforce_pp_baseline(state: rg.State, prompts: rg.Prompts, *, n=4, clip=0.2, kl=0.0, temperature=1.0, top_p=1.0, stop=(),
                          max_new_tokens=None, epochs=1, micro_batch_size=None):
    check_hparams("reinforce_pp_baseline", group_estimator="reinforce_pp_baseline", n=n, clip=clip, kl=kl,
                  max_new_tokens=max_new_tokens, epochs=epochs, micro_batch_size=micro_batch_size)
    ro = rg.generate(state.policy, prompts, n=n, temperature=temperature, top_p=top_p,
                     max_new_tokens=max_new_tokens, stop=stop)  # Rollouts[N, T]
    r = rg.score(state.reward, ro)                                     # [N]
    adv = F.reinforce_pp_baseline(r, ro.group, ro.mask)[:, None]       # [N, 1]
    ref = rg.logprobs(state.ref, ro, temperature=temperature) if kl else None  # [N, T]

    def loss(lp, entropy):                                             # lp, entropy: [N, T], with gradients
        value, clip_frac, approx_kl = F.ppo_clip(lp, ro.logprobs, adv, ro.mask, clip_low=clip)
        kl_term = F.token_mean(F.kl_k3(lp, ref), ro.mask) if kl else None  # []
        total = value + kl * kl_term if kl else value                   # []
        return total, {"clip_frac": clip_frac, "approx_kl": approx_kl, **loss_metrics(lp, ro, entropy, kl=kl_term)}

    policy = rg.update(state.policy, ro, loss, epochs=epochs, temperature=temperature, micro_batch_size=micro_batch_size)
    return state.replace(policy=policy), rollout_metrics(r, ro)
