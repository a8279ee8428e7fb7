"""Property-test your own policy loss with `rlgraph.testing`: micro-batch invariance (the loss
and gradients of a batch equal those of its micro-batches accumulated) and padding invariance
(padding tokens change nothing). A failure prints the shrunk counterexample as Python.

    python examples/property_test_loss.py
    pytest examples/property_test_loss.py     # the same checks as tests
"""

from __future__ import annotations

import torch

import rlgraph.testing as rgt
from rlgraph import functional as F


def clipped_ratio_loss(logprobs, old_logprobs, advantages, mask, *, clip=0.2):
    """PPO-clip with a token-mean over the whole batch: -min(rho A, clip(rho) A)."""
    ratio = torch.exp(logprobs - old_logprobs)                               # [N, T]
    clipped = torch.clamp(ratio, 1 - clip, 1 + clip)                         # [N, T]
    surrogate = -torch.minimum(ratio * advantages, clipped * advantages)     # [N, T]
    return F.token_mean(surrogate, mask)                                     # []


def per_sequence_mean_loss(logprobs, old_logprobs, advantages, mask):
    """A common mistake: the mean over each sequence, then over sequences, weights tokens unequally."""
    ratio = torch.exp(logprobs - old_logprobs)                               # [N, T]
    per_row = (ratio * advantages * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # [N]
    return -per_row.mean()                                                   # []


def subject(loss):
    return lambda b: loss(b.logprobs, b.old_logprobs, b.advantages, b.mask)


def test_token_mean_loss_is_microbatch_invariant():
    rgt.assert_microbatch_invariant(subject(clipped_ratio_loss))


def test_token_mean_loss_is_padding_invariant():
    rgt.assert_padding_invariant(subject(clipped_ratio_loss))


def test_sequence_mean_loss_is_caught():
    """The checker finds that a per-sequence mean depends on how the batch is split."""
    try:
        rgt.assert_microbatch_invariant(subject(per_sequence_mean_loss))
    except rgt.PropertyFailure as failure:
        assert "RolloutBatch" in str(failure)  # the counterexample, as code
        return
    raise AssertionError("the per-sequence mean loss passed micro-batch invariance")


if __name__ == "__main__":
    for test in (test_token_mean_loss_is_microbatch_invariant, test_token_mean_loss_is_padding_invariant,
                 test_sequence_mean_loss_is_caught):
        test()
        print(f"{test.__name__}: ok")
