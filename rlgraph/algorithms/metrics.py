"""The standard per-step metrics of the policy-gradient algorithms, as nodes of their programs.

    return state.replace(policy=policy), rollout_metrics(r, ro)           # in the algorithm
    return total, {"clip_frac": c, **loss_metrics(lp, ro, entropy, kl=k)}  # in its loss closure

Rollout side (`rollout_metrics`, one `rollout_stats` node, run on the controller over the whole batch):

    reward                      mean of the scores r over the batch
    reward/std                  std of the scores, Bessel-corrected (torch.std's default, as verl); 0 for one rollout
    response_length/mean, /max  tokens per response, ro.mask.sum(-1) (an EOS counts, padding does not)
    response_length/clip_frac   fraction of responses that fill all T tokens, T being the generation
                                budget max_new_tokens (executors pad responses to it). A response
                                whose EOS is exactly its T-th token counts too: the rollouts do not
                                carry the EOS id (verl's `response_length/clip_ratio` is the same)

Loss side (`loss_metrics`, inside the loss closure; the update reports them as `policy/<name>`, each
a token mean over the mini-batch, averaged over the optimizer steps like `policy/clip_frac`):

    logprob_diff  token_mean |lp - ro.logprobs|: the trainer's log-probs against the sampler's. On
                  the first optimizer step of an on-policy update this is exactly the rollout vs
                  training mismatch; with several epochs or mini-batches the later steps add the
                  policy's own movement since sampling.
    entropy       token_mean of the policy's per-token entropy, from the training forward itself
                  (the LM head computes it in the same pass: no extra forward)
    kl            the token_mean KL_k3(pi || ref) term the loss adds (only with a reference, kl > 0)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rlgraph import functional as F
from rlgraph.ir.ops import traceable


@traceable
def rollout_stats(scores: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(mean, std of scores f32[N]; mean, max response length; fraction at the budget), all f32[].

    std is Bessel-corrected (torch.std) and 0 for a single score (torch.std: NaN); lengths count
    the True positions of mask bool[N,T]; a response at the budget has its last position True.
    """
    mask = mask.to(torch.bool)
    length = mask.sum(dim=-1).to(torch.float32)  # [N]
    full = mask[:, -1] if mask.shape[-1] else torch.zeros_like(length, dtype=torch.bool)  # [N]: all T tokens used
    std = scores.std() if scores.numel() > 1 else scores.new_zeros(())  # []
    return scores.mean(), std, length.mean(), length.amax(), full.to(torch.float32).mean()


def rollout_metrics(r: Any, ro: Any) -> dict[str, Any]:
    """The rollout-side metrics of a step from the scores `r` [N] and rollouts `ro` (module docstring)."""
    mean, std, length, longest, clipped = rollout_stats(r, ro.mask)  # each []
    return {"reward": mean, "reward/std": std, "response_length/mean": length, "response_length/max": longest,
            "response_length/clip_frac": clipped}


@traceable
def logprob_diff(lp: Tensor, rollout_lp: Tensor, mask: Tensor) -> Tensor:
    """token_mean |lp - rollout_lp| f32[], detached: the trainer's log-probs against the sampler's."""
    return F.token_mean((lp - rollout_lp).abs(), mask).detach()  # []


def loss_metrics(lp: Any, ro: Any, entropy: Any = None, *, kl: Any = None) -> dict[str, Any]:
    """The loss-side metrics (module docstring), detached; `entropy` [N, T] and `kl` (the loss's
    token-mean KL term []) only when the closure has them."""
    metrics = {"logprob_diff": logprob_diff(lp, ro.logprobs, ro.mask)}
    if entropy is not None:
        metrics["entropy"] = F.token_mean(entropy, ro.mask).detach()  # []
    if kl is not None:
        metrics["kl"] = kl.detach()  # []
    return metrics
