"""rlgraph.functional: advantage estimators, losses, KL estimators and masked aggregations.

Pure torch functions with static shapes; each is one `@traceable` op of the IR. See
docs/functional.md for the table of formulas, sources and edge-case conventions. Group advantage
estimators and policy losses are also registered by name (`get_estimator`, `get_loss`).
"""

from rlgraph.functional.advantages import (
    decoupled_gae, discounted_returns, gae, gpg, group_has_variance, group_normalize, length_adaptive_lambda, opo,
    reinforce_pp, reinforce_pp_baseline, remax, rewards_at_last_token, rloo,
)
from rlgraph.functional.aggregate import (
    LossNormalization, active_loss_normalization, global_counts, loss_normalization, masked_max, masked_mean,
    masked_sum, masked_var, masked_whiten, seq_mean_token_mean, seq_mean_token_sum, seq_mean_token_sum_norm, token_mean,
)
from rlgraph.functional.correction import truncated_is_weights
from rlgraph.functional.distill import distill_advantage, generalized_jsd, gkd_loss
from rlgraph.functional.estimator import estimator
from rlgraph.functional.kl import (
    KL_ESTIMATORS, adaptive_kl_coef, entropy_from_logits, kl_abs, kl_k1, kl_k2, kl_k3, kl_low_var, kl_mse,
)
from rlgraph.functional.losses import (
    POLICY_LOSS_KL, clip_cov, cispo, entropy_bonus, gpg_loss, gspo, kl_cov, policy_loss, positive_nll, positive_token_weight,
    ppo_clip, value_loss,
)
from rlgraph.functional.registry import (
    ESTIMATORS, LOSSES, UnknownNameError, get_estimator, get_loss, register_estimator, register_loss,
)

__all__ = [
    # aggregate
    "LossNormalization", "active_loss_normalization", "global_counts", "loss_normalization", "masked_max",
    "masked_mean", "masked_sum", "masked_var", "masked_whiten", "seq_mean_token_mean", "seq_mean_token_sum",
    "seq_mean_token_sum_norm", "token_mean",
    # correction
    "truncated_is_weights",
    # distill
    "distill_advantage", "generalized_jsd", "gkd_loss",
    # estimator
    "estimator",
    # kl
    "KL_ESTIMATORS", "adaptive_kl_coef", "entropy_from_logits", "kl_abs", "kl_k1", "kl_k2", "kl_k3", "kl_low_var", "kl_mse",
    # advantages
    "decoupled_gae", "discounted_returns", "gae", "gpg", "group_has_variance", "group_normalize", "length_adaptive_lambda",
    "opo", "reinforce_pp", "reinforce_pp_baseline", "remax", "rewards_at_last_token", "rloo",
    # losses
    "POLICY_LOSS_KL", "clip_cov", "cispo", "entropy_bonus", "gpg_loss", "gspo", "kl_cov", "policy_loss", "positive_nll",
    "positive_token_weight", "ppo_clip", "value_loss",
    # registry
    "ESTIMATORS", "LOSSES", "UnknownNameError", "get_estimator", "get_loss", "register_estimator", "register_loss",
]
