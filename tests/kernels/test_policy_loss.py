"""Fused policy loss: Triton (interpreter) vs torch reference vs `rlgraph.functional`.

Tolerances: values and gradients rtol 1e-5, atol 1e-6 (ratios reach exp(20), so only relative
error is meaningful); the functional comparison uses atol 1e-5 on bounded inputs.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rlgraph.functional as F
from rlgraph.kernels.policy_loss import (
    AGGREGATIONS, policy_loss, policy_loss_reference, policy_loss_triton, ppo_clip_fused,
)

FUNCTIONAL_AGG = {"token-mean": F.token_mean, "seq-mean-token-sum": F.seq_mean_token_sum,
                  "seq-mean-token-mean": F.seq_mean_token_mean, "seq-mean-token-sum-norm": F.seq_mean_token_sum_norm}
FUNCTIONAL_KL = {"k1": F.kl_k1, "k2": F.kl_k2, "k3": F.kl_k3}


def _batch(N, T, seed, spread=3.0, adv_shape="n", garbage=True, empty_rows=1):
    """lp (requires grad), old_lp, ref_lp, entropy (requires grad), adv, mask; NaN/inf where masked."""
    gen = torch.Generator().manual_seed(seed)
    old = torch.randn(N, T, generator=gen) * spread - 2.0
    lp = old + torch.randn(N, T, generator=gen) * spread  # log-ratios out to about +-4 spread
    ref = old + torch.randn(N, T, generator=gen) * spread
    entropy = torch.rand(N, T, generator=gen) * 3
    mask = torch.rand(N, T, generator=gen) > 0.3
    mask[:min(empty_rows, N)] = False
    adv = {"n": torch.randn(N, generator=gen), "n1": torch.randn(N, 1, generator=gen),
           "nt": torch.randn(N, T, generator=gen)}[adv_shape]
    if garbage:
        for t, bad in ((lp, math.nan), (old, math.inf), (ref, -math.inf), (entropy, math.nan)):
            t.masked_fill_(~mask, bad)
    return lp.requires_grad_(), old, ref, entropy.requires_grad_(), adv, mask


def _run(fn, lp, ent, *args, **kw):
    out = fn(lp, *args, entropy=ent, **kw)
    grads = torch.autograd.grad(out.loss, [lp, ent])
    return out, grads


def _assert_same(a, b, rtol=1e-5, atol=1e-6):
    (out_a, grads_a), (out_b, grads_b) = a, b
    for name, x, y in zip(out_a._fields, out_a, out_b):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")
    for x, y in zip(grads_a, grads_b):
        assert torch.isfinite(x).all()
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol)


@settings(max_examples=60, deadline=None)
@given(N=st.integers(1, 12), T=st.integers(1, 9), seed=st.integers(0, 2**16), agg=st.sampled_from(AGGREGATIONS),
       kl=st.sampled_from([None, "k1", "k2", "k3"]), dual=st.sampled_from([None, 3.0]),
       adv_shape=st.sampled_from(["n", "n1", "nt"]), spread=st.sampled_from([0.1, 3.0, 15.0]),
       counts=st.booleans(), clip=st.sampled_from([(0.2, None), (0.2, 0.28), (0.1, 2.5)]))
def test_triton_matches_reference(N, T, seed, agg, kl, dual, adv_shape, spread, counts, clip):
    lp, old, ref, ent, adv, mask = _batch(N, T, seed, spread=spread, adv_shape=adv_shape)
    kw = dict(ref_lp=ref if kl else None, kl_estimator=kl or "k3", kl_coef=0.1 if kl else 0.0, dual_clip=dual,
              clip_low=clip[0], clip_high=clip[1], entropy_coef=0.01, agg=agg)
    if counts:
        kw.update(tokens=int(mask.sum()) + 5, sequences=N + 2, horizon=T + 3)
    _assert_same(_run(policy_loss_triton, lp, ent, old, adv, mask, **kw),
                 _run(policy_loss_reference, lp, ent, old, adv, mask, **kw))


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("kl", ["k1", "k2", "k3"])
def test_reference_matches_functional(agg, kl):
    """policy_loss == ppo_clip + kl_coef agg(kl) - entropy_coef entropy_bonus, under loss_normalization."""
    lp, old, ref, ent, adv, mask = _batch(6, 7, seed=11, spread=1.0, garbage=False)
    tokens, sequences, horizon = 40, 9, 12
    out = policy_loss_reference(lp, old, adv, mask, ref_lp=ref, entropy=ent, clip_low=0.2, clip_high=0.3,
                                dual_clip=3.0, kl_coef=0.05, kl_estimator=kl, entropy_coef=0.01, agg=agg,
                                tokens=tokens, sequences=sequences, horizon=horizon)
    aggregate = FUNCTIONAL_AGG[agg]
    with F.loss_normalization(tokens, sequences, horizon):
        pg, clip_fraction, approx_kl = F.ppo_clip(lp, old, adv[:, None], mask, clip_low=0.2, clip_high=0.3,
                                                  dual_clip=3.0, agg=aggregate)
        kl_term = aggregate(FUNCTIONAL_KL[kl](lp, ref), mask)
        expected = pg + 0.05 * kl_term - 0.01 * F.entropy_bonus(ent, mask, agg=aggregate)
    torch.testing.assert_close(out.loss, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.clip_fraction, clip_fraction)
    torch.testing.assert_close(out.approx_kl, approx_kl)
    got = torch.autograd.grad(out.loss, [lp, ent])
    want = torch.autograd.grad(expected, [lp, ent])
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_micro_batches_add_up_to_the_mini_batch(agg):
    lp, old, ref, ent, adv, mask = _batch(10, 8, seed=4)
    counts = dict(tokens=int(mask.sum()), sequences=int(mask.any(-1).sum()), horizon=8)
    kw = dict(ref_lp=ref, kl_coef=0.1, entropy=ent, entropy_coef=0.02, agg=agg, **counts)
    full = policy_loss_triton(lp, old, adv, mask, **kw)
    (full_grad,) = torch.autograd.grad(full.loss, [lp])
    pieces, grads = [], []
    for rows in (slice(0, 3), slice(3, 10)):
        piece_kw = dict(kw, ref_lp=ref[rows], entropy=ent[rows])
        part = policy_loss_triton(lp[rows], old[rows], adv[rows], mask[rows], **piece_kw)
        pieces.append(part)
        grads.append(torch.autograd.grad(part.loss, [lp])[0])
    torch.testing.assert_close(sum(p.loss for p in pieces), full.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sum(p.clip_fraction for p in pieces), full.clip_fraction)
    torch.testing.assert_close(sum(grads), full_grad)


def test_ties_split_the_gradient_like_torch():
    """Exact ties follow torch's max/min rule (half the gradient to each side); clip bounds are inclusive.

    The log-ratios are float32 values whose exp is exact in torch and numpy: 2.0 and 1.5.
    """
    lp = torch.tensor([[0.6931471824645996, 0.40546509623527527, 0.0, 0.3]]).requires_grad_()
    old = torch.zeros(1, 4)
    adv = torch.tensor([[-1.0, 1.0, 1.0, 0.0]])  # dual-clip tie at r = c = 2; r on the 1 + 0.5 bound; r = 1; A = 0
    mask = torch.ones(1, 4, dtype=torch.bool)
    kw = dict(clip_low=0.25, clip_high=0.5, dual_clip=2.0, agg="seq-mean-token-sum")
    grads = [torch.autograd.grad(impl(lp, old, adv, mask, **kw).loss, [lp])[0]
             for impl in (policy_loss_triton, policy_loss_reference)]
    torch.testing.assert_close(grads[0], grads[1])
    torch.testing.assert_close(grads[1], torch.tensor([[1.0, -1.5, -1.0, 0.0]]))


@pytest.mark.parametrize("kl", ["k1", "k2", "k3"])
def test_log_ratio_sweep_through_every_clamp(kl):
    """lp - old and ref - lp from -25 to 25: the +-20 log-ratio clamp, the PPO band and k3's 10 cap."""
    steps = torch.linspace(-25.0, 25.0, 201)
    lp = steps.repeat(2, 1).requires_grad_()  # [2, 201]
    old, ref = torch.zeros(2, 201), torch.zeros(2, 201)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 201, dtype=torch.bool)
    kw = dict(ref_lp=ref, kl_coef=0.3, kl_estimator=kl, dual_clip=3.0)
    outs = [impl(lp, old, adv, mask, **kw) for impl in (policy_loss_triton, policy_loss_reference)]
    torch.testing.assert_close(outs[0].loss, outs[1].loss, rtol=1e-5, atol=1e-6)
    grads = [torch.autograd.grad(out.loss, [lp])[0] for out in outs]
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-7)


def test_fully_masked_batch_gives_zero():
    lp, old, ref, ent, adv, mask = _batch(3, 5, seed=1, empty_rows=3)
    out, (grad_lp, grad_ent) = _run(policy_loss_triton, lp, ent, old, adv, mask, ref_lp=ref, kl_coef=1.0,
                                    agg="seq-mean-token-mean")
    assert all(float(x.detach()) == 0.0 for x in out)
    assert not grad_lp.any() and not grad_ent.any()


def test_extreme_log_ratios_stay_finite():
    lp, old, ref, ent, adv, mask = _batch(4, 6, seed=2, empty_rows=0, garbage=False)
    lp = (old + torch.tensor([30.0, -30.0, 19.5, -20.5]).repeat(6).view(4, 6)).detach().requires_grad_()
    a = _run(policy_loss_triton, lp, ent, old, adv, mask, ref_lp=ref, kl_coef=0.5, kl_estimator="k3")
    b = _run(policy_loss_reference, lp, ent, old, adv, mask, ref_lp=ref, kl_coef=0.5, kl_estimator="k3")
    _assert_same(a, b)
    assert torch.isfinite(a[0].loss)


def test_ppo_clip_fused_is_functional_ppo_clip():
    lp, old, _, _, adv, mask = _batch(5, 6, seed=9, garbage=False)
    got = ppo_clip_fused(lp, old, adv, mask, clip_low=0.2, clip_high=0.28, agg=F.seq_mean_token_mean)
    want = F.ppo_clip(lp, old, adv[:, None], mask, clip_low=0.2, clip_high=0.28, agg=F.seq_mean_token_mean)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y)


def test_cpu_default_is_the_reference():
    lp, old, _, _, adv, mask = _batch(2, 3, seed=0, garbage=False)
    assert policy_loss(lp, old, adv, mask).loss.grad_fn.name() != "_FusedPolicyLossBackward"


@pytest.mark.parametrize("kw, match", [(dict(dual_clip=1.0), "dual_clip"), (dict(agg="sum"), "aggregation"),
                                       (dict(kl_estimator="k9"), "kl_estimator")])
def test_bad_options_are_refused(kw, match):
    lp, old, _, _, adv, mask = _batch(2, 3, seed=0)
    with pytest.raises(ValueError, match=match):
        policy_loss_triton(lp, old, adv, mask, **kw)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match=r"adv must be \[N\]"):
        policy_loss_reference(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3, dtype=torch.bool))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (compiled Triton)")
@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_cuda_triton_matches_reference(agg):
    lp, old, ref, ent, adv, mask = (t.cuda() if t is not None else t for t in _batch(256, 1000, seed=0))
    lp, ent = lp.detach().requires_grad_(), ent.detach().requires_grad_()
    kw = dict(ref_lp=ref, kl_coef=0.1, dual_clip=3.0, clip_high=0.28, entropy_coef=0.01, agg=agg)
    _assert_same(_run(policy_loss_triton, lp, ent, old, adv, mask, **kw),
                 _run(policy_loss_reference, lp, ent, old, adv, mask, **kw), rtol=1e-4, atol=1e-6)
