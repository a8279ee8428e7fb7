"""PPO for language models with a learned critic (Schulman et al., 2017, arXiv 1707.06347;
RLHF form of Ouyang et al., 2022, as verl's `gae` estimator).

    r_t    = r [t = last] - beta (log pi_old - log pi_ref)_t          (KL in the reward)
    beta   = kl (fixed), or with kl_target set: beta' = beta (1 + clip(KL/kl_target - 1, +-0.2) N/kl_horizon),
             carried in the state from one iteration to the next (adaptive controller, Ziegler et al. 2019)
    A_t    = whiten( sum_l (gamma lam)^l delta_{t+l} ),  delta_t = r_t + gamma V_{t+1} - V_t
    R_t    = A_t (before whitening) + V_t
    L_pi   = token_mean( max(-A rho, -A clip(rho, 1-eps, 1+eps)) )
    L_V    = 0.5 token_mean( max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2) )
"""

import rlgraph as rg
from rlgraph import functional as F
from rlgraph.algorithms.shaping import kl_penalized_token_rewards


@rg.algorithm
def ppo(state: rg.State, prompts: rg.Prompts, *, n=1, clip=0.2, value_clip=0.5, kl=0.0, kl_target=None,
        kl_horizon=10000, gamma=1.0, lam=0.95, temperature=1.0, max_new_tokens=None, epochs=1, minibatches=1,
        micro_batch_size=None):
    ro = rg.generate(state.policy, prompts, n=n, temperature=temperature, max_new_tokens=max_new_tokens)  # Rollouts[N, T]
    r = rg.score(state.reward, ro)                                     # [N]
    metrics = {"reward": r.mean()}
    if kl_target is None:                                              # fixed beta (0: no reference pass)
        token_rewards = kl_penalized_token_rewards(state, ro, r, kl=kl, temperature=temperature)  # [N, T]
    else:                                                              # adaptive beta, carried in the state
        beta = state.carry("kl_coef", init=kl)                         # []
        ref_kl = F.kl_k1(ro.logprobs, rg.logprobs(state.ref, ro, temperature=temperature))  # [N, T]
        token_rewards = F.rewards_at_last_token(r, ro.mask) - beta * ref_kl  # [N, T]
        state = state.replace(kl_coef=F.adaptive_kl_coef(beta, ref_kl, ro.mask, target=kl_target, horizon=kl_horizon))
        metrics.update(kl_coef=beta, ref_kl=F.masked_mean(ref_kl, ro.mask))
    old_values = rg.values(state.critic, ro)                           # [N, T]
    adv, returns = F.gae(token_rewards, old_values, ro.mask, gamma=gamma, lam=lam)  # [N, T], [N, T]
    adv = F.masked_whiten(adv, ro.mask)                                # [N, T]

    def policy_loss(lp):                                               # lp: [N, T], with gradients
        value, clip_frac, approx_kl = F.ppo_clip(lp, ro.logprobs, adv, ro.mask, clip_low=clip)
        return value, {"clip_frac": clip_frac, "approx_kl": approx_kl}

    def critic_loss(values):                                           # values: [N, T], with gradients
        value, clip_frac = F.value_loss(values, old_values, returns, ro.mask, clip=value_clip)
        return value, {"clip_frac": clip_frac}

    policy = rg.update(state.policy, ro, policy_loss, epochs=epochs, minibatches=minibatches, temperature=temperature,
                       micro_batch_size=micro_batch_size)
    critic = rg.update(state.critic, ro, critic_loss, epochs=epochs, minibatches=minibatches,
                       micro_batch_size=micro_batch_size)
    return state.replace(policy=policy, critic=critic), {**metrics, "value": F.masked_mean(old_values, ro.mask)}
