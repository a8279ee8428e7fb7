import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import rlgraph.functional as F
import rlgraph.testing as rgt
from rlgraph.batches import BatchError
from rlgraph.ir.ops import op_info

from ._batches import random_batch

# groups are not contiguous: group 2 = rows {0, 2} (all equal), group 0 = rows {1, 3, 4}, group 5 = row {5}
REWARDS = torch.tensor([1.0, 0.0, 1.0, 0.5, 0.5, 3.0])
GROUP = torch.tensor([2, 0, 2, 0, 0, 5])
CENTERED = [0.0, -1 / 3, 0.0, 1 / 6, 1 / 6, 0.0]  # group 0 has mean 1/3


def close(actual, expected, **kw):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), **kw)


# -- group estimators ---------------------------------------------------------------------------


def test_group_normalize_by_hand():
    std = math.sqrt((1 / 9 + 1 / 36 + 1 / 36) / 2)  # unbiased std of group 0 = sqrt(1/12)
    low, high = -1 / 3 / (std + 1e-6), 1 / 6 / (std + 1e-6)
    close(F.group_normalize(REWARDS, GROUP), [0.0, low, 0.0, high, high, 0.0])
    close(F.group_normalize(REWARDS, GROUP, scale=False), CENTERED)  # Dr.GRPO


def test_rloo_by_hand():
    # row 1: 0 - mean(0.5, 0.5); row 3: 0.5 - mean(0, 0.5)
    close(F.rloo(REWARDS, GROUP), [0.0, -0.5, 0.0, 0.25, 0.25, 0.0])


def test_reinforce_pp_baseline_by_hand():
    # unweighted: centered values have mean 0 and unbiased variance (1/6) / 5 = 1/30
    scale = 1 / math.sqrt(1 / 30 + 1e-8)
    close(F.reinforce_pp_baseline(REWARDS, GROUP), [c * scale for c in CENTERED])
    # token-weighted (verl): lengths [1, 2, 1, 1, 3, 0] -> 8 tokens, mean 0, variance (12/36) / 7 = 1/21
    lengths = torch.tensor([1, 2, 1, 1, 3, 0])
    mask = torch.arange(3)[None, :] < lengths[:, None]
    scale = 1 / math.sqrt(1 / 21 + 1e-8)
    close(F.reinforce_pp_baseline(REWARDS, GROUP, mask), [0.0, -scale / 3, 0.0, scale / 6, scale / 6, 0.0])


def test_gpg_by_hand():
    alpha = 6 / 5  # N / number of non-zero rewards
    close(F.gpg(REWARDS, GROUP), [alpha * c for c in CENTERED])
    close(F.gpg(REWARDS, GROUP, f_norm=2.0), [alpha * c / 2 for c in CENTERED])
    close(F.gpg(torch.zeros(4), torch.zeros(4, dtype=torch.long)), torch.zeros(4))


def test_opo_by_hand():
    lengths = torch.tensor([3, 2, 1, 1, 1, 2])
    mask = torch.arange(4)[None, :] < lengths[:, None]
    # group 0: baseline (0 * 2 + 0.5 * 1 + 0.5 * 1) / 4 = 0.25
    close(F.opo(REWARDS, GROUP, mask), [0.0, -0.25, 0.0, 0.25, 0.25, 0.0])
    # a group with no tokens at all falls back to the plain mean
    close(F.opo(torch.tensor([1.0, 0.0]), torch.tensor([1, 1]), torch.zeros(2, 3, dtype=torch.bool)), [0.5, -0.5])


def test_remax():
    close(F.remax(torch.tensor([1.0, 0.0]), torch.tensor([0.5, 0.5])), [0.5, -0.5])


GROUP_ESTIMATORS = {
    "group_normalize": lambda r, g, m: F.group_normalize(r, g),
    "dr_grpo": lambda r, g, m: F.group_normalize(r, g, scale=False),
    "rloo": lambda r, g, m: F.rloo(r, g),
    "reinforce_pp_baseline": lambda r, g, m: F.reinforce_pp_baseline(r, g, m),
    "gpg": lambda r, g, m: F.gpg(r, g),
    "opo": lambda r, g, m: F.opo(r, g, m),
}


def _reference_group_normalize(rewards, group, eps=1e-6):
    """Loop over groups: the oracle (rlgraph's convention: a singleton group gives 0)."""
    out = torch.zeros_like(rewards)
    for g in group.unique():
        rows = (group == g).nonzero().flatten()
        r = rewards[rows]
        if (r == r[0]).all():  # includes singletons; the loop's mean may round, rlgraph's is exact
            continue
        out[rows] = (r - r.mean()) / (r.std() + eps)
    return out


@st.composite
def grouped_rewards(draw):
    n = draw(st.integers(1, 12))
    group = torch.tensor(draw(st.lists(st.integers(0, n - 1), min_size=n, max_size=n)))
    levels = draw(st.sampled_from([[0.0, 1.0], [0.1, 0.7, 0.3], [-2.5, 4.0, 0.1, 0.9]]))
    rewards = torch.tensor(draw(st.lists(st.sampled_from(levels), min_size=n, max_size=n)))
    return rewards, group, random_batch(draw(st.integers(0, 2**31 - 1)), n, 5)["mask"]


@given(grouped_rewards())
def test_group_normalize_matches_a_loop_over_groups(batch):
    rewards, group, _ = batch
    close(F.group_normalize(rewards, group), _reference_group_normalize(rewards, group), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", sorted(GROUP_ESTIMATORS))
def test_group_estimators_are_permutation_equivariant_and_padding_invariant(name):
    estimator = GROUP_ESTIMATORS[name]
    ragged = rgt.rollout_batches(equal_groups=False, groups=(1, 4))  # plain torch estimators take any group sizes
    rgt.assert_group_permutation_equivariant(lambda b: estimator(b.rewards, b.group, b.mask), batches=ragged,
                                             contiguous=False)
    rgt.assert_padding_invariant(lambda b: estimator(b.rewards, b.group, b.mask), batches=ragged, strict=True)


@given(grouped_rewards(), st.sampled_from(sorted(GROUP_ESTIMATORS)))
def test_singleton_and_all_equal_groups_give_zero(batch, name):
    rewards, _, mask = batch
    n = rewards.shape[0]
    estimator = GROUP_ESTIMATORS[name]
    out = estimator(rewards, torch.arange(n), mask)  # every group has size 1
    assert torch.isfinite(out).all() and (out == 0).all()
    out = estimator(torch.full((n,), 0.3), torch.zeros(n, dtype=torch.long), mask)  # one all-equal group
    assert torch.isfinite(out).all() and (out == 0).all()


# -- token-level estimators ---------------------------------------------------------------------


def test_rewards_at_last_token():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 1]], dtype=torch.bool)
    close(F.rewards_at_last_token(torch.tensor([2.0, 3.0, 4.0]), mask), [[0, 2.0, 0], [0, 0, 0], [0, 0, 4.0]])


def test_discounted_returns_by_hand():
    full = torch.ones(1, 3, dtype=torch.bool)
    close(F.discounted_returns(torch.tensor([[1.0, 2.0, 3.0]]), full, gamma=0.5), [[2.75, 3.5, 3.0]])
    holed = torch.tensor([[True, False, True]])  # the masked token is skipped: its reward is ignored
    close(F.discounted_returns(torch.tensor([[1.0, 9.0, 3.0]]), holed, gamma=0.5), [[2.5, 0.0, 3.0]])


def test_reinforce_pp_by_hand():
    rewards = torch.tensor([[1.0, 5.0], [3.0, 5.0]])
    mask = torch.tensor([[True, False], [True, False]])
    # returns {1, 3}: mean 2, unbiased variance 2
    close(F.reinforce_pp(rewards, mask), [[-1 / math.sqrt(2), 0.0], [1 / math.sqrt(2), 0.0]], rtol=1e-5, atol=1e-6)


def test_gae_by_hand():
    rewards, values = torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.6, 0.7]])
    full = torch.ones(1, 3, dtype=torch.bool)
    advantages, returns = F.gae(rewards, values, full)  # gamma = lam = 1: Monte Carlo
    close(advantages, [[0.5, 0.4, 0.3]])
    close(returns, [[1.0, 1.0, 1.0]])
    # gamma 0.9, lam 0.5: delta = [0.04, 0.03, 0.3]; A2 = 0.3, A1 = 0.03 + 0.45 A2, A0 = 0.04 + 0.45 A1
    advantages, returns = F.gae(rewards, values, full, gamma=0.9, lam=0.5)
    close(advantages, [[0.11425, 0.165, 0.3]])
    close(returns, [[0.61425, 0.765, 1.0]])


def _reference_gae(rewards, values, mask, gamma, lam):
    """verl's recurrence (float-mask arithmetic), without its final whitening."""
    m = mask.to(rewards.dtype)
    next_value = last = torch.zeros(rewards.shape[0], dtype=rewards.dtype)
    reversed_advantages = []
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        candidate = delta + gamma * lam * last
        next_value = values[:, t] * m[:, t] + (1 - m[:, t]) * next_value
        last = candidate * m[:, t] + (1 - m[:, t]) * last
        reversed_advantages.append(last)
    advantages = torch.stack(reversed_advantages[::-1], dim=1)
    return advantages * m, (advantages + values) * m


@given(st.integers(0, 2**31 - 1), st.integers(1, 6), st.integers(1, 8), st.floats(0.5, 1.0), st.floats(0.0, 1.0))
def test_gae_matches_verls_recurrence(seed, n, t, gamma, lam):
    batch = random_batch(seed, n, t)
    rewards, values, mask = batch["returns"], batch["values"], batch["mask"]
    expected = _reference_gae(rewards, values, mask, gamma, lam)
    for actual, wanted in zip(F.gae(rewards, values, mask, gamma=gamma, lam=lam), expected):
        torch.testing.assert_close(actual, wanted)


# -- VAPO: length-adaptive lambda, decoupled GAE ----------------------------------------------------


def test_length_adaptive_lambda_by_hand():
    # lengths 40, 100, 20, 10, 0 at alpha = 0.05: 1 - 1/2, 1 - 1/5, 1 - 1/1, 1 - 2 (< 0: clamped), empty row
    mask = torch.arange(100)[None, :] < torch.tensor([40, 100, 20, 10, 0])[:, None]
    close(F.length_adaptive_lambda(mask, alpha=0.05), [0.5, 0.8, 0.0, 0.0, 0.0])
    close(F.length_adaptive_lambda(mask[:, :4], alpha=1.0), [0.75, 0.75, 0.75, 0.75, 0.0])  # lengths 4 (x4) and 0
    with pytest.raises(ValueError, match="alpha must be > 0"):
        F.length_adaptive_lambda(mask, alpha=0.0)


def test_decoupled_gae_by_hand():
    # row 0: r = [0, 0, 1], V = [0.5, 0.2, 0.4]; row 1 padded after 2 tokens, r = [0, 2], V = [1, 0.5]
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, math.nan]])
    values = torch.tensor([[0.5, 0.2, 0.4], [1.0, 0.5, math.inf]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    # gamma 1: delta row 0 = [-0.3, 0.2, 0.6], row 1 = [-0.5, 1.5]
    # lam_policy 0.5 (row 0): A = [-0.3 + 0.5 * 0.5, 0.2 + 0.5 * 0.6, 0.6]; lam_policy 0 (row 1): A = delta
    # lam_critic 1: R = the Monte-Carlo return, [1, 1, 1] and [2, 2]
    advantages, returns = F.decoupled_gae(rewards, values, mask, torch.tensor([0.5, 0.0]))
    close(advantages, [[-0.05, 0.5, 0.6], [-0.5, 1.5, 0.0]])
    close(returns, [[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]])
    # gamma 0.9: delta row 0 = [-0.32, 0.16, 0.6]; A1 = 0.16 + 0.45 * 0.6, A0 = -0.32 + 0.45 * A1; R = 0.9^k
    advantages, returns = F.decoupled_gae(rewards[:1], values[:1], mask[:1], 0.5, gamma=0.9)
    close(advantages, [[-0.1265, 0.43, 0.6]])
    close(returns, [[0.81, 0.9, 1.0]])


@given(st.integers(0, 2**31 - 1), st.integers(1, 6), st.integers(1, 8), st.floats(0.5, 1.0), st.floats(0.0, 1.0))
def test_decoupled_gae_is_gae_twice(seed, n, t, gamma, lam):
    """Per-row lambdas give each row's own GAE; lam_critic = 1 gives the Monte-Carlo returns."""
    batch = random_batch(seed, n, t)
    rewards, values, mask = batch["returns"], batch["values"], batch["mask"]
    lam_rows = torch.linspace(0.0, 1.0, n) * lam  # [N]
    advantages, returns = F.decoupled_gae(rewards, values, mask, lam_rows, gamma=gamma)
    for row in range(n):
        wanted, _ = _reference_gae(rewards[row:row + 1], values[row:row + 1], mask[row:row + 1], gamma, float(lam_rows[row]))
        torch.testing.assert_close(advantages[row:row + 1], wanted)
    torch.testing.assert_close(returns, F.discounted_returns(rewards, mask, gamma=gamma), rtol=1e-5, atol=1e-5)
    _, critic_returns = F.decoupled_gae(rewards, values, mask, lam_rows, gamma=gamma, lam_critic=lam)
    torch.testing.assert_close(critic_returns, F.gae(rewards, values, mask, gamma=gamma, lam=lam)[1])


TOKEN_ESTIMATORS = {
    "discounted_returns": lambda r, v, m: F.discounted_returns(r, m, gamma=0.9),
    "reinforce_pp": lambda r, v, m: F.reinforce_pp(r, m, gamma=0.9),
    "gae": lambda r, v, m: torch.stack(F.gae(r, v, m, gamma=0.9, lam=0.8)),
    "decoupled_gae": lambda r, v, m: torch.stack(F.decoupled_gae(r, v, m, F.length_adaptive_lambda(m, alpha=0.5),
                                                                 gamma=0.9)),
}


@given(st.integers(0, 2**31 - 1), st.integers(1, 6), st.integers(1, 8), st.integers(0, 3),
       st.sampled_from(sorted(TOKEN_ESTIMATORS)))
def test_token_estimators_are_padding_invariant(seed, n, t, extra, name):
    estimator = TOKEN_ESTIMATORS[name]
    batch = random_batch(seed, n, t)
    rewards, values, mask = batch["returns"], batch["values"], batch["mask"]
    expected = estimator(rewards, values, mask)
    padded_mask = torch.nn.functional.pad(mask, (0, extra))
    garbage = torch.full((n, t + extra), math.nan, dtype=rewards.dtype)
    padded = [torch.where(padded_mask, torch.nn.functional.pad(x, (0, extra)), garbage) for x in (rewards, values)]
    actual = estimator(*padded, padded_mask)
    assert torch.isfinite(actual).all()
    torch.testing.assert_close(actual[..., :t], expected)
    assert (actual[..., t:] == 0).all()


# -- tracing contract ---------------------------------------------------------------------------

N, T = 35, 11


def meta(*shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device="meta")


REW, GRP, MASK, TOK = meta(N), meta(N, dtype=torch.long), meta(N, T, dtype=torch.bool), meta(N, T)


@pytest.mark.parametrize(
    "fn, args, shapes",
    [
        (F.group_normalize, (REW, GRP), [(N,)]),
        (F.rloo, (REW, GRP), [(N,)]),
        (F.reinforce_pp_baseline, (REW, GRP, MASK), [(N,)]),
        (F.reinforce_pp_baseline, (REW, GRP), [(N,)]),
        (F.gpg, (REW, GRP), [(N,)]),
        (F.opo, (REW, GRP, MASK), [(N,)]),
        (F.remax, (REW, REW), [(N,)]),
        (F.rewards_at_last_token, (REW, MASK), [(N, T)]),
        (F.discounted_returns, (TOK, MASK), [(N, T)]),
        (F.reinforce_pp, (TOK, MASK), [(N, T)]),
        (F.gae, (TOK, TOK, MASK), [(N, T), (N, T)]),
        (F.length_adaptive_lambda, (MASK,), [(N,)]),
        (F.decoupled_gae, (TOK, TOK, MASK, REW), [(N, T), (N, T)]),
    ],
)
def test_runs_on_meta_tensors(fn, args, shapes):
    out = op_info(fn).impl(*args)  # what the tracer runs
    outs = out if isinstance(out, tuple) else (out,)
    assert [tuple(o.shape) for o in outs] == shapes and all(o.dtype == torch.float32 for o in outs)


@pytest.mark.parametrize("name", ["group_normalize", "rloo", "gpg", "group_has_variance"])
@pytest.mark.parametrize("group, message", [
    ([0, 0, 3], "group id 3 at row 2 is outside \\[0, N=3\\)"),
    ([0, -1, 0], "group id -1 at row 1 is outside \\[0, N=3\\)"),
    ([0.0, 0.0, 1.0], "group must hold integer ids \\(i64\\[N\\]\\), got torch.float32"),
])
def test_group_ids_outside_the_batch_are_refused_naming_the_value(name, group, message):
    """Eager calls on real tensors: index_add would raise a bare IndexError deep in torch."""
    with pytest.raises(BatchError, match=f"F.{name}: {message}(.|\n)*fix: "):
        getattr(F, name)(torch.tensor([1.0, 2.0, 3.0]), torch.tensor(group))
