"""PPO for language models with a learned critic (Schulman et al., 2017, arXiv 1707.06347;
RLHF form of Ouyang et al., 2022, as verl's `gae` estimator).

    r_t    = r [t = last] - beta (log pi_old - log pi_ref)_t          (KL in the reward)
    beta   = kl (fixed), or with kl_target set: beta' = beta (1 + clip(KL/kl_target - 1, +-0.2) N/kl_horizon),
             carried in the state from one iteration to the next (adaptive controller, Ziegler et al. 2019)
    A_t    = whiten( sum_l (gamma lam)^l delta_{t+l} ),  delta_t = r_t + gamma V_{t+1} - V_t
    R_t    = A_t (before whitening) + V_t
    L_pi   = token_mean( max(-A rho, -A clip(rho, 1-eps, 1+eps)) )
    L_V    = 0.5 token_mean( max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2) )

`tis_cap` (e.g. 2.0) turns on the rollout correction (`rlgraph.algorithms.correction`): pi_old's
log-probs are recomputed on the trainer (in rho and in the KL), each token's policy loss is
weighted by min(exp(log pi_old - log pi_sampler), tis_cap), and `logprob_mismatch/mean|max`
report |log pi_old - log pi_sampler| every step.
"""

import rlgraph as rg
from rlgraph import functional as F
from rlgraph.algorithms.hparams import check_hparams
from rlgraph.algorithms.correction import check_tis_cap, rollout_correction
from rlgraph.algorithms.metrics import loss_metrics, rollout_metrics
from rlgraph.algorithms.shaping import kl_penalized_token_rewards


@rg.algorithm
def ppo(state: rg.State, prompts: rg.Prompts, *, n=1, clip=0.2, value_clip=0.5, kl=0.0, kl_target=None,
        kl_horizon=10000, gamma=1.0, lam=0.95, temperature=1.0, top_p=1.0, stop=(), max_new_tokens=None, epochs=1, minibatches=1,
        micro_batch_size=None, tis_cap=None):
    check_hparams("ppo", n=n, clip=clip, value_clip=value_clip, kl=kl, kl_target=kl_target, kl_horizon=kl_horizon,
                  gamma=gamma, lam=lam, max_new_tokens=max_new_tokens, epochs=epochs, minibatches=minibatches,
                  micro_batch_size=micro_batch_size)
    tis_cap = check_tis_cap(tis_cap, "ppo")                            # None: no rollout correction
    ro = rg.generate(state.policy, prompts, n=n, temperature=temperature, top_p=top_p,
                     max_new_tokens=max_new_tokens, stop=stop)  # Rollouts[N, T]
    r = rg.score(state.reward, ro)                                     # [N]
    metrics = {}                                                       # the KL's and the correction's
    correction = rollout_correction(state, ro, cap=tis_cap, temperature=temperature) if tis_cap is not None else None
    old_lp = None if correction is None else correction.old_logprobs  # [N, T]; None: the sampler's ro.logprobs
    if correction is not None:
        metrics.update(correction.metrics)
    if kl_target is None:                                              # fixed beta (0: no reference pass)
        token_rewards, kl_metrics = kl_penalized_token_rewards(state, ro, r, kl=kl, temperature=temperature,
                                                               old_lp=old_lp)  # [N, T]
        metrics.update(kl_metrics)
    else:                                                              # adaptive beta, carried in the state
        beta = state.carry("kl_coef", init=kl)                         # []
        old = ro.logprobs if old_lp is None else old_lp                # [N, T]
        ref_kl = F.kl_k1(old, rg.logprobs(state.ref, ro, temperature=temperature))  # [N, T]
        token_rewards = F.rewards_at_last_token(r, ro.mask) - beta * ref_kl  # [N, T]
        state = state.replace(kl_coef=F.adaptive_kl_coef(beta, ref_kl, ro.mask, target=kl_target, horizon=kl_horizon))
        metrics.update(kl_coef=beta, ref_kl=F.masked_mean(ref_kl, ro.mask))
    old_values = rg.values(state.critic, ro)                           # [N, T]
    adv, returns = F.gae(token_rewards, old_values, ro.mask, gamma=gamma, lam=lam)  # [N, T], [N, T]
    adv = F.masked_whiten(adv, ro.mask)                                # [N, T]

    def policy_loss(lp, entropy):                                      # lp, entropy: [N, T], with gradients
        old, weighted = (ro.logprobs, adv) if correction is None else (old_lp, adv * correction.weights)  # w_t * loss_t
        value, clip_frac, approx_kl = F.ppo_clip(lp, old, weighted, ro.mask, clip_low=clip)
        return value, {"clip_frac": clip_frac, "approx_kl": approx_kl, **loss_metrics(lp, ro, entropy)}

    policy = rg.update(state.policy, ro, policy_loss, epochs=epochs, minibatches=minibatches, temperature=temperature,
                       micro_batch_size=micro_batch_size)
    critic = critic_update(state, ro, old_values, returns, value_clip=value_clip, epochs=epochs,
                           minibatches=minibatches, micro_batch_size=micro_batch_size)
    return state.replace(policy=policy, critic=critic), {**rollout_metrics(r, ro), **metrics,
                                                         "value": F.masked_mean(old_values, ro.mask)}


def critic_update(state, ro, old_values, returns, *, value_clip, epochs, minibatches, micro_batch_size):
    """critic@v+1: the clipped value loss towards `returns` [N, T] (PPO's and VAPO's critic step)."""
    def critic_loss(values):                                           # values: [N, T], with gradients
        value, clip_frac = F.value_loss(values, old_values, returns, ro.mask, clip=value_clip)
        return value, {"clip_frac": clip_frac}

    return rg.update(state.critic, ro, critic_loss, epochs=epochs, minibatches=minibatches,
                     micro_batch_size=micro_batch_size)
