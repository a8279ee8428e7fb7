"""rlgraph.kernels: fused Triton kernels, each with a torch reference, and the registry that picks one.

See `registry` for the dispatch rule and docs/benchmarks.md ("Kernels") for measured figures.
"""

from rlgraph.kernels.advantages import (
    discounted_returns_reference, discounted_returns_triton, gae_reference, gae_triton, group_normalize_reference,
    group_normalize_triton, reinforce_pp_baseline_reference, reinforce_pp_baseline_triton, rloo_reference,
    rloo_triton,
)
from rlgraph.kernels.logprob_head import (
    token_logprobs, token_logprobs_chunked, token_logprobs_reference, token_logprobs_triton,
)
# `policy_loss` the function is not re-exported: it would hide the module of the same name.
from rlgraph.kernels.policy_loss import PolicyLoss, policy_loss_reference, policy_loss_triton, ppo_clip_fused
from rlgraph.kernels.registry import Kernel, available_kernels, dispatch, register

__all__ = [
    "discounted_returns_reference", "discounted_returns_triton", "gae_reference", "gae_triton",
    "group_normalize_reference", "group_normalize_triton", "reinforce_pp_baseline_reference",
    "reinforce_pp_baseline_triton", "rloo_reference", "rloo_triton",
    "token_logprobs", "token_logprobs_chunked", "token_logprobs_reference", "token_logprobs_triton",
    "PolicyLoss", "policy_loss_reference", "policy_loss_triton", "ppo_clip_fused",
    "Kernel", "available_kernels", "dispatch", "register",
]
