"""VAPO (Yue et al., 2025, arXiv 2504.05118): value-model-augmented PPO, i.e. PPO with a critic plus five changes.

The first two come from VC-PPO (arXiv 2503.01491):

    value pre-training   the first `value_warmup` iterations train only the critic, on samples of the
                         warm-started policy (its loss is multiplied by 0 until then; verl: critic_warmup)
    decoupled GAE        R_t = V_t + sum_l (gamma lam_critic)^l delta_{t+l}, lam_critic = 1 (Monte-Carlo)
    length-adaptive GAE  A_t = sum_l (gamma lam_i)^l delta_{t+l},  lam_i = 1 - 1 / (alpha |y_i|)
    clip-higher, token-level loss
                         L_PPO = token_mean( max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high)) )
    positive-example LM loss
                         L = L_PPO + mu L_NTP,  L_NTP = -mean over tokens of correct samples of log pi
    group sampling       n samples per prompt (the paper: 512 prompts x 16)

    delta_t = r_t + gamma V_{t+1} - V_t, r_t = r [t = last];  A whitened over the batch, as verl's GAE does;
    L_V = 0.5 token_mean( max((V - R)^2, (clip(V, V_old +- c) - R)^2) ).  No KL term (as DAPO).

A sample is correct (positive) when its reward is >= `positive_reward`.
"""

import torch

import rlgraph as rg
from rlgraph import functional as F
from rlgraph.algorithms.hparams import check_hparams
from rlgraph.algorithms.metrics import loss_metrics, rollout_metrics
from rlgraph.algorithms.ppo import critic_update


@rg.algorithm
def vapo(state: rg.State, prompts: rg.Prompts, *, n=8, clip_low=0.2, clip_high=0.28, value_clip=0.5, alpha=0.05,
         lam_critic=1.0, gamma=1.0, lm_coef=0.1, positive_reward=1.0, value_warmup=0, temperature=1.0, top_p=1.0,
         stop=(), max_new_tokens=None, epochs=1, minibatches=1, micro_batch_size=None):
    check_hparams("vapo", n=n, clip_low=clip_low, clip_high=clip_high, value_clip=value_clip, alpha=alpha,
                  lam_critic=lam_critic, gamma=gamma, lm_coef=lm_coef, positive_reward=positive_reward,
                  value_warmup=value_warmup, max_new_tokens=max_new_tokens, epochs=epochs, minibatches=minibatches,
                  micro_batch_size=micro_batch_size)
    ro = rg.generate(state.policy, prompts, n=n, temperature=temperature, top_p=top_p,
                     max_new_tokens=max_new_tokens, stop=stop)         # Rollouts[N, T]
    r = rg.score(state.reward, ro)                                     # [N]
    old_values = rg.values(state.critic, ro)                           # [N, T]
    lam_policy = F.length_adaptive_lambda(ro.mask, alpha=alpha)        # [N]
    adv, returns = F.decoupled_gae(F.rewards_at_last_token(r, ro.mask), old_values, ro.mask, lam_policy,
                                   gamma=gamma, lam_critic=lam_critic)  # [N, T], [N, T]
    adv = F.masked_whiten(adv, ro.mask)                                # [N, T]
    positive = r >= positive_reward                                    # bool[N]: the correct samples
    lm_weight = F.positive_token_weight(ro.mask, positive)             # []
    iteration = state.carry("vapo_iteration", init=0.0)                # []: iterations run before this one
    policy_on = (iteration >= value_warmup).to(torch.float32)          # []: 0 while the critic pre-trains

    def policy_loss(lp, entropy):                                      # lp, entropy: [N, T], with gradients
        pg, clip_frac, approx_kl = F.ppo_clip(lp, ro.logprobs, adv, ro.mask, clip_low=clip_low, clip_high=clip_high,
                                              agg=F.token_mean)
        nll = F.positive_nll(lp, ro.mask, positive, lm_weight)         # []
        return policy_on * (pg + lm_coef * nll), {"clip_frac": clip_frac, "approx_kl": approx_kl, "positive_nll": nll,
                                                 **loss_metrics(lp, ro, entropy)}

    policy = rg.update(state.policy, ro, policy_loss, epochs=epochs, minibatches=minibatches, temperature=temperature,
                       micro_batch_size=micro_batch_size)
    critic = critic_update(state, ro, old_values, returns, value_clip=value_clip, epochs=epochs,
                           minibatches=minibatches, micro_batch_size=micro_batch_size)  # R: lam_critic's returns
    return state.replace(policy=policy, critic=critic, vapo_iteration=iteration + 1.0), {
        **rollout_metrics(r, ro), "value": F.masked_mean(old_values, ro.mask), "policy_on": policy_on,
        "lam_policy": lam_policy.mean(), "positive_fraction": positive.to(torch.float32).mean()}
