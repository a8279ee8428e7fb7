import math

import pytest
import torch

import rlgraph.functional as F
from rlgraph.ir.ops import op_info

ESTIMATORS = [F.kl_k1, F.kl_abs, F.kl_k2, F.kl_k3]
LP = torch.tensor([0.0, -1.0, -2.0])
REF = torch.tensor([-1.0, -1.0, 0.0])  # lp - ref = [1, 0, -2]


def close(actual, expected):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype))


def test_estimators_by_hand():
    close(F.kl_k1(LP, REF), [1.0, 0.0, -2.0])
    close(F.kl_abs(LP, REF), [1.0, 0.0, 2.0])
    close(F.kl_k2(LP, REF), [0.5, 0.0, 2.0])
    # ref - lp = [-1, 0, 2]: exp(x) - x - 1
    close(F.kl_k3(LP, REF), [math.exp(-1), 0.0, math.exp(2) - 3])


def test_aliases_and_lookup_table():
    assert F.kl_mse is F.kl_k2 and F.kl_low_var is F.kl_k3
    assert F.KL_ESTIMATORS["low_var_kl"] is F.kl_k3 and F.KL_ESTIMATORS["kl"] is F.kl_k1
    assert F.KL_ESTIMATORS["mse"] is F.kl_k2 and F.KL_ESTIMATORS["abs"] is F.kl_abs


def test_nonnegative_estimators_are_zero_at_equality():
    for kl in (F.kl_abs, F.kl_k2, F.kl_k3):
        x = torch.randn(50)
        assert (kl(x, x) == 0).all()
        assert (kl(x, torch.randn(50)) >= 0).all()


def test_extreme_log_ratios_stay_finite():
    lp = torch.tensor([50.0, -50.0, 0.0], requires_grad=True)
    ref = torch.zeros(3)
    close(F.kl_k1(lp, ref), [50.0, -50.0, 0.0])
    close(F.kl_k2(lp, ref), [1250.0, 1250.0, 0.0])
    close(F.kl_k3(lp, ref), [10.0, 10.0, 0.0])  # verl's clamps: log-ratio to +-20, result to +-10
    for kl in ESTIMATORS:
        (grad,) = torch.autograd.grad(kl(lp, ref).sum(), lp)
        assert torch.isfinite(grad).all()


def test_k3_gradient_matches_the_formula():
    lp = torch.tensor([-0.5, -1.5], requires_grad=True)
    ref = torch.tensor([-1.0, -1.0])
    (grad,) = torch.autograd.grad(F.kl_k3(lp, ref).sum(), lp)
    close(grad, 1 - torch.exp(ref - lp.detach()))  # d/dlp [exp(ref - lp) - (ref - lp) - 1]


def test_entropy_from_logits():
    close(F.entropy_from_logits(torch.zeros(2, 3, 4)), torch.full((2, 3), math.log(4)))
    peaked = torch.tensor([[[0.0, -math.inf, -math.inf]]])
    close(F.entropy_from_logits(peaked), [[0.0]])
    logits = torch.randn(3, 5, 7)
    probs = torch.softmax(logits, -1)
    close(F.entropy_from_logits(logits), torch.logsumexp(logits, -1) - (probs * logits).sum(-1))  # verl's form


@pytest.mark.parametrize("fn", ESTIMATORS)
def test_runs_on_meta_tensors(fn):
    out = op_info(fn).impl(torch.empty(35, 11, device="meta"), torch.empty(35, 11, device="meta"))
    assert out.shape == (35, 11) and out.dtype == torch.float32


def test_entropy_runs_on_meta_tensors():
    out = op_info(F.entropy_from_logits).impl(torch.empty(35, 11, 23, device="meta"))
    assert out.shape == (35, 11)
