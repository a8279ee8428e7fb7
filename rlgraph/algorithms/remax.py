"""ReMax (Li et al., 2023, arXiv 2310.10505): REINFORCE with the greedy answer's reward as baseline.

    A_i = r(x, y_i) - r(x, y_greedy(x))
    L   = token_mean( max(-A_i rho_it, -A_i clip(rho_it, 1-eps, 1+eps)) )

The baseline costs one extra greedy generation per prompt (B rows, against N = B*n samples);
`greedy_r[ro.group]` gives every sample the baseline of its own prompt.
"""

import rlgraph as rg
from rlgraph import functional as F
from rlgraph.algorithms.hparams import check_hparams
from rlgraph.algorithms.metrics import loss_metrics, rollout_metrics


@rg.algorithm
def remax(state: rg.State, prompts: rg.Prompts, *, n=1, clip=0.2, temperature=1.0, top_p=1.0, stop=(),
          max_new_tokens=None, epochs=1, micro_batch_size=None):
    check_hparams("remax", n=n, clip=clip, max_new_tokens=max_new_tokens, epochs=epochs,
                  micro_batch_size=micro_batch_size)
    ro = rg.generate(state.policy, prompts, n=n, temperature=temperature, top_p=top_p,
                     max_new_tokens=max_new_tokens, stop=stop)  # Rollouts[N, T]
    greedy = rg.generate(state.policy, prompts, n=1, temperature=0.0, max_new_tokens=max_new_tokens,
                         stop=stop)                                    # Rollouts[B, T'], ended as `ro` is
    r = rg.score(state.reward, ro)                                     # [N]
    greedy_r = rg.score(state.reward, greedy)                          # [B]
    adv = F.remax(r, greedy_r[ro.group])[:, None]                      # [N, 1]: each sample gets its prompt's baseline

    def loss(lp, entropy):                                             # lp, entropy: [N, T], with gradients
        value, clip_frac, approx_kl = F.ppo_clip(lp, ro.logprobs, adv, ro.mask, clip_low=clip)
        return value, {"clip_frac": clip_frac, "approx_kl": approx_kl, **loss_metrics(lp, ro, entropy)}

    policy = rg.update(state.policy, ro, loss, epochs=epochs, temperature=temperature, micro_batch_size=micro_batch_size)
    return state.replace(policy=policy), {**rollout_metrics(r, ro), "greedy_reward": greedy_r.mean()}
