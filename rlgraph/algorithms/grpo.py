"""GRPO (Shao et al., 2024, DeepSeekMath): group-normalised rewards as advantages, PPO-clip loss.

    A_i = (r_i - mean(r_group)) / (std(r_group) + eps)
    L   = token_mean( -min(rho * A, clip(rho, 1-eps_low, 1+eps_high) * A) + beta * KL_k3(pi || pi_ref) )

`estimator` and `loss` name any registered group estimator and policy loss (`rlgraph list`), e.g.
`estimator="rloo"` or `loss="gspo"`; `clip` and `clip_high` go to losses that take `clip_low` and
`clip_high`. The defaults are the GRPO above.

`tis_cap` (e.g. 2.0) turns on the rollout correction for a generator whose log-probs differ from
the trainer's (bf16 vLLM vs fp32 FSDP): the old log-probs are recomputed on the trainer, each
token's loss is weighted by min(exp(old_lp - ro.logprobs), tis_cap), and the metrics
`logprob_mismatch/mean` and `logprob_mismatch/max` report |old_lp - ro.logprobs| every step
(`rlgraph.algorithms.correction`).

Metrics: `rlgraph.algorithms.metrics` (reward, reward/std, response_length/*; policy/logprob_diff,
policy/entropy, policy/kl with kl > 0), plus the loss's own (policy/clip_frac, policy/approx_kl).
"""

import rlgraph as rg
from rlgraph import functional as F
from rlgraph.algorithms.hparams import check_hparams
from rlgraph.algorithms.correction import check_tis_cap, rollout_correction
from rlgraph.algorithms.metrics import loss_metrics, rollout_metrics


@rg.algorithm
def grpo(state: rg.State, prompts: rg.Prompts, *, n=8, estimator="group_normalize", loss="ppo_clip", clip=0.2,
         clip_high=None, kl=0.0, temperature=1.0, top_p=1.0, stop=(), max_new_tokens=None, epochs=1, micro_batch_size=None,
         tis_cap=None):
    check_hparams("grpo", group_estimator=estimator, n=n, clip=clip, clip_high=clip_high, kl=kl,
                  max_new_tokens=max_new_tokens, epochs=epochs, micro_batch_size=micro_batch_size)
    estimate, policy_loss = F.get_estimator(estimator), F.get_loss(loss)  # names -> functions (`rlgraph list`)
    tis_cap = check_tis_cap(tis_cap, "grpo", loss)                     # None: no rollout correction
    ro = rg.generate(state.policy, prompts, n=n, temperature=temperature, top_p=top_p,
                     max_new_tokens=max_new_tokens, stop=stop)  # Rollouts[N, T]
    r = rg.score(state.reward, ro)                                     # [N]
    mask = ro.mask if estimate.takes_mask else None                    # read only by length-aware estimators
    adv = estimate(r, ro.group, n=n, mask=mask)[:, None]               # [N, 1]
    ref = rg.logprobs(state.ref, ro, temperature=temperature) if kl else None  # [N, T]
    clipping = policy_loss.supported(clip_low=clip, clip_high=clip if clip_high is None else clip_high)  # {} if no clip
    correction = rollout_correction(state, ro, cap=tis_cap, temperature=temperature) if tis_cap is not None else None
    old_lp = ro.logprobs if correction is None else correction.old_logprobs  # [N, T] sampler's, or trainer's

    def loss(lp, entropy):                                             # lp, entropy: [N, T], with gradients
        weighted = adv if correction is None else adv * correction.weights  # [N, 1] or [N, T]: w_t * loss_t
        surrogate, *metrics = policy_loss(lp, old_lp, weighted, ro.mask, **clipping)
        kl_term = F.token_mean(F.kl_k3(lp, ref), ro.mask) if kl else None  # []
        total = surrogate + kl * kl_term if kl else surrogate           # []
        return total, {**dict(zip(policy_loss.metrics, metrics)), **loss_metrics(lp, ro, entropy, kl=kl_term)}

    policy = rg.update(state.policy, ro, loss, epochs=epochs, temperature=temperature, micro_batch_size=micro_batch_size)
    metrics = {**rollout_metrics(r, ro), **(correction.metrics if correction is not None else {})}
    return state.replace(policy=policy), metrics
