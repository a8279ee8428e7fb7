import math

import pytest
import torch

import rlgraph.functional as F
import rlgraph.testing as rgt
from rlgraph.ir.ops import op_info

LOG = math.log


def close(actual, expected, **kw):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), **kw)


# one row of three tokens and a masked fourth: ratios 0.5, 1.5, 3 (truncated to the cap 2), garbage
ROLLOUT = torch.tensor([[-1.0, -2.0, -0.5, math.nan]])
TRAIN = ROLLOUT + torch.tensor([[LOG(0.5), LOG(1.5), LOG(3.0), math.inf]])
MASK = torch.tensor([[True, True, True, False]])


def test_truncated_weights_by_hand():
    close(F.truncated_is_weights(TRAIN, ROLLOUT, MASK, cap=2.0), [[0.5, 1.5, 2.0, 0.0]])
    close(F.truncated_is_weights(TRAIN, ROLLOUT, MASK, cap=1.2), [[0.5, 1.2, 1.2, 0.0]])
    close(F.truncated_is_weights(ROLLOUT, ROLLOUT, MASK, cap=2.0), [[1.0, 1.0, 1.0, 0.0]])  # no mismatch: 1


def test_weights_are_detached_and_finite_for_extreme_log_ratios():
    train = torch.tensor([[50.0, -50.0, 0.0]], requires_grad=True)
    weights = F.truncated_is_weights(train, torch.zeros(1, 3), torch.ones(1, 3, dtype=torch.bool), cap=2.0)
    assert not weights.requires_grad
    close(weights, [[2.0, math.exp(-20.0), 1.0]])  # log-ratio clamped to +-20 before exp, as verl
    assert (weights > 0).all()  # a positive factor: folding it into the advantage keeps the clip's side


@pytest.mark.parametrize("cap, error, message", [
    (0.0, ValueError, "must be > 0"),
    (-1.0, ValueError, "must be > 0"),
    (math.nan, ValueError, "must be > 0"),
    ("2.0", TypeError, "must be a number > 0"),
    (True, TypeError, "must be a number > 0"),
])
def test_bad_caps_are_refused(cap, error, message):
    with pytest.raises(error, match=f"truncated_is_weights: cap {message}"):
        F.truncated_is_weights(TRAIN, ROLLOUT, MASK, cap=cap)


def test_an_infinite_cap_is_plain_importance_sampling():
    close(F.truncated_is_weights(TRAIN, ROLLOUT, MASK, cap=math.inf), [[0.5, 1.5, 3.0, 0.0]])


def test_is_a_row_wise_op_that_runs_on_meta_tensors():
    assert op_info(F.truncated_is_weights).rows == "row"  # shard-safe: runs on each data-parallel shard
    meta = torch.empty(35, 11, device="meta")
    mask = torch.empty(35, 11, dtype=torch.bool, device="meta")
    out = op_info(F.truncated_is_weights).impl(meta, meta, mask, cap=2.0)
    assert out.shape == (35, 11) and out.dtype == torch.float32


def _weights(b):
    return F.truncated_is_weights(b.old_logprobs, b.ref_logprobs, b.mask, cap=2.0)  # ref_logprobs: the sampler's


def test_padding_never_matters():
    rgt.assert_padding_invariant(_weights, strict=True)  # NaN in padding: torch.where, not x * mask


def test_a_weighted_loss_is_micro_batch_invariant():
    rgt.assert_microbatch_invariant(
        lambda b: F.ppo_clip(b.logprobs, b.old_logprobs, b.advantages * _weights(b), b.mask))
