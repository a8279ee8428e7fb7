"""Reward shaping shared by token-level algorithms (PPO, REINFORCE++)."""

import rlgraph as rg
from rlgraph import functional as F


def kl_penalized_token_rewards(state, ro, r, *, kl, temperature, old_lp=None):
    """The sequence reward on the last response token, minus `kl * KL_k1(pi_old || pi_ref)` per token,
    and the metrics of the penalty: `ref_kl`, the token mean of that KL ({} when kl == 0).

    r_t = [t = last] * r - kl * (log pi_old(y_t) - log pi_ref(y_t));  no reference pass when kl == 0.
    `old_lp` [N, T] are the old policy's log-probs (default: the sampler's, `ro.logprobs`).
    """
    token_rewards = F.rewards_at_last_token(r, ro.mask)                # [N, T]
    if not kl:
        return token_rewards, {}
    ref = rg.logprobs(state.ref, ro, temperature=temperature)          # [N, T]
    ref_kl = F.kl_k1(ro.logprobs if old_lp is None else old_lp, ref)   # [N, T]
    return token_rewards - kl * ref_kl, {"ref_kl": F.masked_mean(ref_kl, ro.mask)}  # [N, T], {[]}
