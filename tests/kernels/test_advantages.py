"""Advantage kernels: Triton (interpreter) vs torch reference vs `rlgraph.functional`.

Tolerances: atol 1e-5, rtol 1e-5 (sums in a different order); exact zeros where the convention
says 0 (singleton groups, all-equal groups, masked positions).
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rlgraph.functional as F
from rlgraph.kernels import advantages as K

TOL = dict(atol=1e-5, rtol=1e-5)


@st.composite
def grouped_rewards(draw):
    """rewards f32[N] (ties, or floats out to 1e4) and group ids i64[N] in [0, N), sizes including 1."""
    N = draw(st.integers(1, 12))
    ids = draw(st.lists(st.integers(0, N - 1), min_size=N, max_size=N))
    if draw(st.booleans()):
        rewards = draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=N, max_size=N))
    else:
        rewards = draw(st.lists(st.floats(-1e4, 1e4, width=32), min_size=N, max_size=N))
    return torch.tensor(rewards, dtype=torch.float32), torch.tensor(ids, dtype=torch.long)


@st.composite
def token_batch(draw):
    """rewards, values f32[N, T] and a ragged mask bool[N, T] with holes and fully masked rows."""
    N, T = draw(st.integers(1, 12)), draw(st.integers(1, 9))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (N,), generator=gen)  # 0 = fully masked row
    mask = torch.arange(T)[None, :] < lengths[:, None]  # [N, T] right padding
    if draw(st.booleans()):
        mask &= torch.rand(N, T, generator=gen) > 0.25  # holes (tool observations)
    return torch.randn(N, T, generator=gen) * 3, torch.randn(N, T, generator=gen), mask


GROUP_CASES = [
    ("group_normalize", dict(), F.group_normalize),
    ("group_normalize", dict(scale=False), F.group_normalize),
    ("rloo", dict(), F.rloo),
    ("reinforce_pp_baseline", dict(), F.reinforce_pp_baseline),
]


@pytest.mark.parametrize("name, kw, functional", GROUP_CASES)
@settings(max_examples=30, deadline=None)
@given(batch=grouped_rewards())
def test_group_kernels_match(name, kw, functional, batch):
    rewards, group = batch
    triton_out = getattr(K, f"{name}_triton")(rewards, group, **kw)
    reference = getattr(K, f"{name}_reference")(rewards, group, **kw)
    scale = max(1.0, float(rewards.abs().max()))
    torch.testing.assert_close(triton_out / scale, reference / scale, **TOL)
    torch.testing.assert_close(reference / scale, functional(rewards, group, **kw) / scale, **TOL)


@settings(max_examples=30, deadline=None)
@given(batch=grouped_rewards(), data=st.data())
def test_reinforce_pp_baseline_weighs_rows_by_tokens(batch, data):
    rewards, group = batch
    lengths = torch.tensor(data.draw(st.lists(st.integers(0, 5), min_size=len(rewards), max_size=len(rewards))))
    mask = torch.arange(5)[None, :] < lengths[:, None]  # [N, 5]
    out = K.reinforce_pp_baseline_triton(rewards, group, mask)
    reference = K.reinforce_pp_baseline_reference(rewards, group, mask)
    torch.testing.assert_close(out, reference, **TOL)
    torch.testing.assert_close(reference, F.reinforce_pp_baseline(rewards, group, mask), **TOL)
    assert (out[lengths == 0] == 0).all()


@pytest.mark.parametrize("impl", [K.group_normalize_triton, K.rloo_triton, K.group_normalize_reference])
def test_singletons_and_equal_groups_give_exact_zero(impl):
    rewards = torch.tensor([0.3, 0.7, 0.7, 0.7, 5.0, 1e4, 1e4])
    group = torch.tensor([0, 3, 3, 3, 1, 6, 6])  # 0 and 1 singletons; 3 and 6 all equal
    assert (impl(rewards, group) == 0).all()


def test_non_contiguous_groups():
    rewards = torch.tensor([1.0, 0.0, 3.0, 2.0, 5.0, 4.0])
    group = torch.tensor([2, 0, 2, 0, 2, 0])
    torch.testing.assert_close(K.group_normalize_triton(rewards, group), F.group_normalize(rewards, group))
    torch.testing.assert_close(K.rloo_triton(rewards, group), torch.tensor([-3.0, -3.0, 0.0, 0.0, 3.0, 3.0]))


@settings(max_examples=30, deadline=None)
@given(batch=token_batch(), gamma=st.sampled_from([1.0, 0.99, 0.5]), lam=st.sampled_from([1.0, 0.95, 0.0]))
def test_gae_matches(batch, gamma, lam):
    rewards, values, mask = batch
    adv, ret = K.gae_triton(rewards, values, mask, gamma=gamma, lam=lam)
    ref_adv, ref_ret = K.gae_reference(rewards, values, mask, gamma=gamma, lam=lam)
    fn_adv, fn_ret = F.gae(rewards, values, mask, gamma=gamma, lam=lam)
    for got, want, functional in ((adv, ref_adv, fn_adv), (ret, ref_ret, fn_ret)):
        torch.testing.assert_close(got, want, **TOL)
        torch.testing.assert_close(want, functional, **TOL)
        assert (got[~mask] == 0).all()


@settings(max_examples=30, deadline=None)
@given(batch=token_batch(), gamma=st.sampled_from([1.0, 0.9]))
def test_discounted_returns_match(batch, gamma):
    rewards, _, mask = batch
    out = K.discounted_returns_triton(rewards, mask, gamma=gamma)
    torch.testing.assert_close(out, K.discounted_returns_reference(rewards, mask, gamma=gamma), **TOL)
    torch.testing.assert_close(out, F.discounted_returns(rewards, mask, gamma=gamma), **TOL)


def test_scans_ignore_garbage_at_masked_positions():
    rewards, values = torch.randn(3, 6), torch.randn(3, 6)
    mask = torch.tensor([[1, 1, 0, 1, 0, 0], [0] * 6, [1] * 6], dtype=torch.bool)
    rewards[~mask], values[~mask] = float("nan"), float("inf")
    adv, ret = K.gae_triton(rewards, values, mask, gamma=0.9, lam=0.8)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    torch.testing.assert_close(adv, K.gae_reference(rewards, values, mask, gamma=0.9, lam=0.8)[0])


def test_shape_errors():
    with pytest.raises(ValueError, match="rewards f32\\[N\\] and group"):
        K.group_normalize_triton(torch.zeros(3), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="one shape \\[N, T\\]"):
        K.gae_triton(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3, dtype=torch.bool))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (compiled Triton)")
def test_cuda_kernels_match_reference():
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 2, (4096,), generator=gen).float().cuda()
    group = (torch.randperm(4096, generator=gen) // 8).cuda()
    for name in ("group_normalize", "rloo", "reinforce_pp_baseline"):
        torch.testing.assert_close(getattr(K, f"{name}_triton")(rewards, group),
                                   getattr(K, f"{name}_reference")(rewards, group), **TOL)
    token_rewards, values = torch.randn(512, 300, generator=gen).cuda(), torch.randn(512, 300, generator=gen).cuda()
    mask = (torch.rand(512, 300, generator=gen) > 0.1).cuda()
    for got, want in zip(K.gae_triton(token_rewards, values, mask, gamma=0.99, lam=0.95),
                         K.gae_reference(token_rewards, values, mask, gamma=0.99, lam=0.95)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_reinforce_pp_baseline_of_equal_weighted_values_is_exactly_zero_everywhere():
    """Regression (a CI flake): rows 1 and 2 hold the only tokens and share one centred reward,
    -1/3; every implementation must give exactly 0, not rounding noise times 1/sqrt(eps)."""
    rewards, group = torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.tensor([1, 1, 1, 0])
    mask = torch.arange(5)[None, :] < torch.tensor([0, 2, 4, 0])[:, None]
    for out in (F.reinforce_pp_baseline(rewards, group, mask), K.reinforce_pp_baseline_reference(rewards, group, mask),
                K.reinforce_pp_baseline_triton(rewards, group, mask)):
        assert (out == 0).all(), out
