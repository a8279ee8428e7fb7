"""GRPO (Shao et al., 2024, DeepSeekMath): group-normalised rewards as advantages, PPO-clip loss.

    A_i = (r_i - mean(r_group)) / (std(r_group) + eps)
    L   = token_mean( -min(rho * A, clip(rho, 1-eps_low, 1+eps_high) * A) + beta * KL_k3(pi || pi_ref) )

`estimator` and `loss` name any registered group estimator and policy loss (`rlgraph list`), e.g.
`estimator="rloo"` or `loss="gspo"`; `clip` and `clip_high` go to losses that take `clip_low` and
`clip_high`. The defaults are the GRPO above.
"""

import rlgraph as rg
from rlgraph import functional as F


@rg.algorithm
def grpo(state: rg.State, prompts: rg.Prompts, *, n=8, estimator="group_normalize", loss="ppo_clip", clip=0.2,
         clip_high=None, kl=0.0, temperature=1.0, max_new_tokens=None, epochs=1, micro_batch_size=None):
    estimate, policy_loss = F.get_estimator(estimator), F.get_loss(loss)  # names -> functions (`rlgraph list`)
    ro = rg.generate(state.policy, prompts, n=n, temperature=temperature, max_new_tokens=max_new_tokens)  # Rollouts[N, T]
    r = rg.score(state.reward, ro)                                     # [N]
    mask = ro.mask if estimate.takes_mask else None                    # read only by length-aware estimators
    adv = estimate(r, ro.group, n=n, mask=mask)[:, None]               # [N, 1]
    ref = rg.logprobs(state.ref, ro, temperature=temperature) if kl else None  # [N, T]
    clipping = policy_loss.supported(clip_low=clip, clip_high=clip if clip_high is None else clip_high)  # {} if no clip

    def loss(lp):                                                      # lp: [N, T], with gradients
        surrogate, *metrics = policy_loss(lp, ro.logprobs, adv, ro.mask, **clipping)
        total = surrogate + kl * F.token_mean(F.kl_k3(lp, ref), ro.mask) if kl else surrogate  # []
        return total, dict(zip(policy_loss.metrics, metrics))

    policy = rg.update(state.policy, ro, loss, epochs=epochs, temperature=temperature, micro_batch_size=micro_batch_size)
    return state.replace(policy=policy), {"reward": r.mean()}
