"""rlgraph.functional.distill: on-policy distillation's advantage, the generalised JSD and GKD's
sampled-token estimate, against hand-derived values and the exact full-vocabulary expectation."""

import math

import pytest
import torch
from hypothesis import settings

from rlgraph import functional as F
from rlgraph import testing as rgt

FEW = settings(max_examples=6, deadline=None)
LOG = torch.log


def test_distill_advantage_is_teacher_minus_student_at_real_tokens():
    lp = torch.tensor([[-1.0, -2.0, float("nan")]])
    teacher = torch.tensor([[-1.5, -0.5, -3.0]])
    mask = torch.tensor([[True, True, False]])
    assert torch.equal(F.distill_advantage(lp, teacher, mask), torch.tensor([[-0.5, 1.5, 0.0]]))


@pytest.mark.parametrize(("beta", "want"), [
    (0.0, math.log(2)),                                                        # KL(t||s) = 1 log(1 / (1/2))
    (1.0, math.inf),                                                           # KL(s||t): s puts mass where t has none
    (0.5, 0.5 * math.log(4 / 3) + 0.5 * (0.5 * math.log(2 / 3) + 0.5 * math.log(2))),  # m = (3/4, 1/4)
])
def test_generalized_jsd_by_hand(beta, want):
    student, teacher = LOG(torch.tensor([0.5, 0.5])), LOG(torch.tensor([1.0, 0.0]))
    got = F.generalized_jsd(student, teacher, beta=beta)
    assert float(got) == pytest.approx(want, rel=1e-6)


def test_generalized_jsd_interior_by_hand_and_its_end_point_limits():
    s, t = torch.tensor([0.25, 0.75]), torch.tensor([0.5, 0.5])
    # beta = 1/2: m = (3/8, 5/8)
    want = 0.5 * (0.5 * math.log(4 / 3) + 0.5 * math.log(4 / 5)) + 0.5 * (0.25 * math.log(2 / 3) + 0.75 * math.log(6 / 5))
    assert float(F.generalized_jsd(LOG(s), LOG(t), beta=0.5)) == pytest.approx(want, rel=1e-6)
    # the end points are the limits of JSD/beta and JSD/(1-beta); the error is O(beta) ~ 1e-4 relative
    small = 1e-4
    forward, reverse = F.generalized_jsd(LOG(s), LOG(t), beta=0.0), F.generalized_jsd(LOG(s), LOG(t), beta=1.0)
    assert float(F.generalized_jsd(LOG(s), LOG(t), beta=small) / small) == pytest.approx(float(forward), rel=1e-3)
    assert float(F.generalized_jsd(LOG(s), LOG(t), beta=1 - small) / small) == pytest.approx(float(reverse), rel=1e-3)


@pytest.mark.parametrize("beta", [-0.1, 1.5, float("nan"), True])
def test_beta_outside_zero_one_is_refused(beta):
    with pytest.raises(ValueError, match="beta must be a number in"):
        F.generalized_jsd(torch.zeros(2), torch.zeros(2), beta=beta)


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("sampler", ["student", "teacher"])
def test_sampled_estimate_is_exact_in_expectation_value_and_gradient(beta, sampler):
    """Each vocabulary entry y is one row, weighted by q(y): the estimate's expectation and its
    gradient's must equal the full-vocabulary JSD and its gradient (float64: equal to ~1e-12)."""
    torch.manual_seed(0)
    logits = torch.randn(5, dtype=torch.float64, requires_grad=True)
    teacher = torch.log_softmax(torch.randn(5, dtype=torch.float64), -1)  # [V]
    student = torch.log_softmax(logits, -1)  # [V]
    exact = F.generalized_jsd(student, teacher, beta=beta)
    (want,) = torch.autograd.grad(exact, logits, retain_graph=True)
    q = (student if sampler == "student" else teacher).detach()  # [V]
    expect = lambda values, mask: (values[:, 0] * q.exp()).sum()  # noqa: E731  E_q over the rows
    estimate, _ = F.gkd_loss(student[:, None], q[:, None], teacher[:, None], torch.ones(5, 1, dtype=torch.bool),
                             beta=beta, agg=expect)
    (got,) = torch.autograd.grad(estimate, logits)
    assert float(estimate.detach()) == pytest.approx(float(exact.detach()), rel=1e-9)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_gkd_at_beta_one_on_policy_has_the_gradient_of_distillation():
    torch.manual_seed(1)
    lp = -torch.rand(3, 4, dtype=torch.float64).requires_grad_(True)
    teacher = -torch.rand(3, 4, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    gkd, rho = F.gkd_loss(lp, lp.detach(), teacher, mask, beta=1.0)
    adv = F.distill_advantage(lp.detach(), teacher, mask)
    pg, _, _ = F.ppo_clip(lp, lp.detach(), adv, mask)
    torch.testing.assert_close(torch.autograd.grad(gkd, lp)[0], torch.autograd.grad(pg, lp)[0])
    assert float(rho) == 1.0 and float(gkd.detach()) == pytest.approx(float(F.token_mean(-adv, mask)))


@pytest.mark.parametrize("beta", [0.0, 0.5])  # the two code paths with exp: the importance ratio t/s
def test_gkd_loss_is_micro_batch_and_padding_invariant(beta):
    fn = lambda b: F.gkd_loss(b.logprobs, b.old_logprobs, b.ref_logprobs, b.mask, beta=beta)  # noqa: E731
    rgt.assert_microbatch_invariant(fn, settings=FEW)
    rgt.assert_padding_invariant(fn, strict=True, settings=FEW)


def test_distill_advantage_is_padding_invariant():
    rgt.assert_padding_invariant(lambda b: F.distill_advantage(b.old_logprobs, b.ref_logprobs, b.mask),
                                 strict=True, settings=FEW)
