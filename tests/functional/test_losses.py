import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rlgraph.functional as F
import rlgraph.testing as rgt
from rlgraph.ir.ops import op_info

from ._batches import batch_shapes, random_batch

AGGREGATIONS = [F.token_mean, F.seq_mean_token_sum, F.seq_mean_token_mean, F.seq_mean_token_sum_norm]
LOG = math.log


def close(actual, expected, **kw):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), **kw)


def grad_of(value, wrt):
    return torch.autograd.grad(value, wrt)[0]


# one row, four tokens: ratio 1.5 / 0.5 / 0.5 / 1.5 with advantages +1 / +1 / -1 / -1
OLD = torch.zeros(1, 4)
RATIO_LP = torch.tensor([[LOG(1.5), LOG(0.5), LOG(0.5), LOG(1.5)]])
ADV = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
FULL = torch.ones(1, 4, dtype=torch.bool)


def test_ppo_clip_by_hand():
    lp = RATIO_LP.clone().requires_grad_(True)
    loss, clip_fraction, approx_kl = F.ppo_clip(lp, OLD, ADV, FULL)
    # per token: max(-A r, -A clip(r, 0.8, 1.2)) = [-1.2, -0.5, 0.8, 1.5]; tokens 1 and 3 clipped
    close(loss, (-1.2 - 0.5 + 0.8 + 1.5) / 4)
    close(clip_fraction, 0.5)
    close(approx_kl, -(2 * LOG(1.5) + 2 * LOG(0.5)) / 4)
    close(grad_of(loss, lp), [[0.0, -0.5 / 4, 0.0, 1.5 / 4]])  # d(-A r)/dlp = -A r where unclipped


def test_ppo_clip_higher_and_dual_clip():
    loss, _, _ = F.ppo_clip(RATIO_LP, OLD, ADV, FULL, clip_high=0.28)
    close(loss, (-1.28 - 0.5 + 0.8 + 1.5) / 4)
    lp = torch.tensor([[LOG(5.0), LOG(5.0)]])
    adv = torch.tensor([[-1.0, 1.0]])
    loss, _, _ = F.ppo_clip(lp, torch.zeros(1, 2), adv, torch.ones(1, 2, dtype=torch.bool), dual_clip=3.0)
    close(loss, (3.0 - 1.2) / 2)  # -A r = 5 is bounded by -A c = 3 for A < 0 only
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        F.ppo_clip(lp, torch.zeros(1, 2), adv, torch.ones(1, 2, dtype=torch.bool), dual_clip=0.5)


def test_gspo_by_hand():
    old = torch.zeros(2, 2)
    lp = torch.tensor([[0.1, 0.3], [0.0, 7.0]], requires_grad=True)  # row 2's second token is masked
    mask = torch.tensor([[True, True], [True, False]])
    adv = torch.tensor([[1.0], [-1.0]])
    loss, clip_fraction, approx_kl = F.gspo(lp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    # row 1: s = exp(mean(0.1, 0.3)) = 1.2214 > 1.2, clipped: -1.2 per token; row 2: s = 1: +1
    close(loss, (-1.2 + 1.0) / 2)
    close(clip_fraction, 2 / 3)
    close(approx_kl, -0.4 / 3)
    close(grad_of(loss, lp), [[0.0, 0.0], [0.5, 0.0]])  # d/dlp of -A s_it = -A s; / 1 token / 2 rows


def test_cispo_by_hand():
    lp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    old = lp.detach() - torch.tensor([[LOG(1.5), LOG(0.5), 0.0]])
    adv = torch.tensor([[1.0, 1.0, -2.0]])
    loss, clip_fraction, _ = F.cispo(lp, old, adv, torch.ones(1, 3, dtype=torch.bool))
    # weights sg(clip(r)) = [1.2, 0.8, 1.0]; -w A lp = [1.2, 1.6, -1.0]
    close(loss, 1.8 / 3)
    close(clip_fraction, 2 / 3)
    close(grad_of(loss, lp), [[-1.2 / 3, -0.8 / 3, 2.0 / 3]])  # clipped tokens keep a gradient


def test_gpg_loss_by_hand():
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, clip_fraction, approx_kl = F.gpg_loss(lp, lp.detach() + 0.5, torch.tensor([[2.0], ]),
                                               torch.ones(1, 2, dtype=torch.bool))
    close(loss, (2.0 + 4.0) / 2)
    close(clip_fraction, 0.0)
    close(approx_kl, 0.5)
    close(grad_of(loss, lp), [[-1.0, -1.0]])


# covariance setup: A = [2, -2, 2, -2] (mean 0), lp = [0, -2, -1, -1] (mean -1) -> cov = [2, 2, 0, 0]
COV_ADV = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
COV_LP = torch.tensor([[0.0, -2.0, -1.0, -1.0]])


def test_clip_cov_by_hand():
    # ratio 1 everywhere: nothing is PPO-clipped; candidates cov in (1, 5) = tokens 0 and 1
    loss, clip_fraction, _ = F.clip_cov(COV_LP, COV_LP, COV_ADV, FULL)
    close(loss, (0.0 + 2.0 - 2.0 + 2.0) / 4)  # budget max(floor(2e-4 * 4), 1) = 1: token 0 (tie, first)
    close(clip_fraction, 0.25)
    loss, clip_fraction, _ = F.clip_cov(COV_LP, COV_LP, COV_ADV, FULL, cov_ratio=0.5)
    close(loss, (-2.0 + 2.0) / 4)  # budget 2: tokens 0 and 1
    close(clip_fraction, 0.5)
    loss, _, _ = F.clip_cov(COV_LP, COV_LP, COV_ADV, FULL, priority=torch.tensor([[0.0, 1.0, 9.0, 9.0]]))
    close(loss, (-2.0 + 0.0 - 2.0 + 2.0) / 4)  # the priority picks among candidates only: token 1
    loss, clip_fraction, _ = F.clip_cov(COV_LP, COV_LP, COV_ADV, FULL, cov_low=3.0)
    close(loss, 0.0)  # no candidate: plain PPO-clip
    close(clip_fraction, 0.0)


def test_clip_cov_gradient_is_zero_on_dropped_tokens():
    lp = COV_LP.clone().requires_grad_(True)
    loss, _, _ = F.clip_cov(lp, COV_LP, COV_ADV, FULL)
    close(grad_of(loss, lp), [[0.0, 0.5, -0.5, 0.5]])


def test_kl_cov_by_hand():
    old = COV_LP - torch.tensor([[0.5, 0.0, 0.0, 0.0]])  # token 0 has log-ratio 0.5
    lp = COV_LP.clone().requires_grad_(True)
    loss, fraction, approx_kl = F.kl_cov(lp, old, COV_ADV, FULL)
    # k = 1: token 0 (largest cov, first of a tie) gets + |0.5|; per token -A r = [-2 e^0.5, 2, -2, 2]
    close(loss, (-2 * math.exp(0.5) + 0.5 + 2.0 - 2.0 + 2.0) / 4)
    close(fraction, 0.25)
    close(approx_kl, -0.5 / 4)
    close(grad_of(loss, lp), [[(-2 * math.exp(0.5) + 1.0) / 4, 0.5, -0.5, 0.5]])


def test_kl_cov_budget_uses_python_int_rounding():
    mask = torch.ones(1, 10, dtype=torch.bool)
    lp = torch.arange(10.0)[None]
    _, fraction, _ = F.kl_cov(lp, lp, lp, mask, kl_ratio=0.7)  # int(0.7 * 10) = 7 in float64, 6 in float32
    close(fraction, 0.7)


def test_value_loss_by_hand():
    values = torch.tensor([[1.0, 2.0, 0.0]], requires_grad=True)
    old, returns = torch.tensor([[0.5, 2.0, 1.0]]), torch.tensor([[2.0, 1.0, 0.0]])
    full = torch.ones(1, 3, dtype=torch.bool)
    loss, clip_fraction = F.value_loss(values, old, returns, full, clip=0.2)
    # clipped values [0.7, 2.0, 0.8]: max errors [1.69, 1, 0.64]
    close(loss, 0.5 * (1.69 + 1.0 + 0.64) / 3)
    close(clip_fraction, 2 / 3)
    close(grad_of(loss, values), [[0.0, 1.0 / 3, 0.0]])
    loss, clip_fraction = F.value_loss(values, old, returns, full, clip=None)
    close(loss, 0.5 * (1.0 + 1.0 + 0.0) / 3)
    close(clip_fraction, 0.0)


def test_entropy_bonus():
    entropy = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    mask = torch.tensor([[True, True], [True, False]])
    close(F.entropy_bonus(entropy, mask), 2.0)
    close(F.entropy_bonus(entropy, mask, agg=F.seq_mean_token_mean), (1.5 + 3.0) / 2)


# -- properties ---------------------------------------------------------------------------------

POLICY_LOSSES = {
    "ppo_clip": lambda b, agg: F.ppo_clip(b["lp"], b["old_lp"], b["adv"], b["mask"], agg=agg),
    "ppo_dual_clip": lambda b, agg: F.ppo_clip(b["lp"], b["old_lp"], b["adv"], b["mask"], clip_high=0.28,
                                               dual_clip=3.0, agg=agg),
    "gspo": lambda b, agg: F.gspo(b["lp"], b["old_lp"], b["adv"], b["mask"], agg=agg),
    "cispo": lambda b, agg: F.cispo(b["lp"], b["old_lp"], b["adv"], b["mask"], agg=agg),
    "gpg_loss": lambda b, agg: F.gpg_loss(b["lp"], b["old_lp"], b["adv"], b["mask"], agg=agg),
}
LOSSES = {
    **POLICY_LOSSES,
    "value_loss": lambda b, agg: F.value_loss(b["lp"], b["old_values"], b["returns"], b["mask"], agg=agg),
    "entropy_bonus": lambda b, agg: (F.entropy_bonus(b["lp"], b["mask"], agg=agg),),
}
# Their token selection depends on the statistics of the whole call (as in verl), so they are
# not micro-batch invariant; they are still finite, padding invariant and meta-traceable.
SELECTING_LOSSES = {
    "clip_cov": lambda b, agg: F.clip_cov(b["lp"], b["old_lp"], b["adv"], b["mask"], cov_low=-1e9, cov_high=1e9,
                                          cov_ratio=0.2, agg=agg),
    "kl_cov": lambda b, agg: F.kl_cov(b["lp"], b["old_lp"], b["adv"], b["mask"], kl_ratio=0.2, agg=agg),
}
ALL_LOSSES = {**LOSSES, **SELECTING_LOSSES}


def _rows(batch, rows):
    return {key: value[rows] for key, value in batch.items()}


def as_dict(b, token_adv=True):
    """The names these tests use, from an `rlgraph.testing.RolloutBatch`."""
    return dict(lp=b.logprobs, old_lp=b.old_logprobs, adv=b.advantages if token_adv else b.advantages[:, :1],
                mask=b.mask, values=b.values, old_values=b.old_values, returns=b.returns, entropy=-b.ref_logprobs)


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("agg", AGGREGATIONS, ids=lambda agg: agg.__name__)
def test_micro_batch_losses_metrics_and_gradients_sum_to_the_full_batch(name, agg):
    token_adv = AGGREGATIONS.index(agg) % 2 == 0  # sequence-level advantages ([N, 1]) for half the cases
    rgt.assert_microbatch_invariant(lambda b: LOSSES[name](as_dict(b, token_adv), agg))


@given(batch_shapes(), st.sampled_from(sorted(ALL_LOSSES)), st.sampled_from(AGGREGATIONS), st.integers(0, 3))
def test_padding_and_garbage_never_matter(shape, name, agg, extra):
    seed, n, t, _ = shape
    batch = random_batch(seed, n, t, dtype=torch.float32, token_adv=True)
    with F.loss_normalization(*F.global_counts(batch["mask"]), horizon=8):
        expected = ALL_LOSSES[name](batch, agg)
        mask = torch.nn.functional.pad(batch["mask"], (0, extra))
        dirty = {key: torch.where(mask, torch.nn.functional.pad(value, (0, extra)), math.nan)
                 for key, value in batch.items() if key != "mask"}
        dirty["lp"].requires_grad_(True)
        actual = ALL_LOSSES[name]({**dirty, "mask": mask}, agg)
        grad = grad_of(actual[0], dirty["lp"])
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e)
    assert torch.isfinite(grad).all() and (grad[~mask] == 0).all()


@pytest.mark.parametrize("name", sorted(ALL_LOSSES))
@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_extreme_log_ratios_stay_finite(name, agg):
    batch = random_batch(7, 4, 6, dtype=torch.float32, token_adv=True)
    batch["old_lp"] = batch["lp"] + torch.tensor([50.0, -50.0, 0.0, 50.0, -50.0, 0.0])
    lp = batch["lp"].requires_grad_(True)
    out = ALL_LOSSES[name](batch, agg)
    assert all(torch.isfinite(o).all() for o in out)
    assert torch.isfinite(grad_of(out[0], lp)).all()


@pytest.mark.parametrize("name", sorted(ALL_LOSSES))
def test_fully_masked_batches_give_zero(name):
    batch = random_batch(3, 3, 4, token_adv=True)
    batch["mask"] = torch.zeros(3, 4, dtype=torch.bool)
    out = ALL_LOSSES[name](batch, F.token_mean)
    assert all(o == 0 for o in out)


@pytest.mark.parametrize("name", sorted(SELECTING_LOSSES))
def test_selecting_losses_match_themselves_under_full_batch_normalization(name):
    batch = random_batch(11, 6, 5, token_adv=True)
    outside = SELECTING_LOSSES[name](batch, F.token_mean)
    with F.loss_normalization(*F.global_counts(batch["mask"])):
        inside = SELECTING_LOSSES[name](batch, F.token_mean)
    for a, b in zip(inside, outside):
        torch.testing.assert_close(a, b)


# -- VAPO's positive-example LM loss -----------------------------------------------------------------


def test_positive_nll_by_hand():
    lp = torch.tensor([[-1.0, -2.0, math.nan], [-0.5, math.inf, 0.0], [-3.0, -1.0, -1.0]])
    mask = torch.tensor([[True, True, False], [True, False, False], [True, True, True]])
    positive = torch.tensor([True, False, True])
    weight = F.positive_token_weight(mask, positive)  # 6 tokens / 5 tokens of correct rows
    torch.testing.assert_close(weight, torch.tensor(6 / 5))
    # rows 0 and 2: -(-1 - 2 - 3 - 1 - 1) / 5 tokens; row 1 (wrong) does not count
    torch.testing.assert_close(F.positive_nll(lp, mask, positive, weight), torch.tensor(8 / 5))
    nobody = torch.zeros(3, dtype=torch.bool)
    assert F.positive_nll(lp, mask, nobody, F.positive_token_weight(mask, nobody)).item() == 0.0


def _positive_nll_of(whole):
    """VAPO's LM loss as `rg.update` runs it: the weight from the whole batch, the loss per micro-batch."""
    weight = F.positive_token_weight(whole.mask, whole.rewards > 0)
    return lambda b: F.positive_nll(b.logprobs, b.mask, b.rewards > 0, weight)


@settings(max_examples=10)
@given(rgt.rollout_batches(), st.data())
def test_positive_nll_micro_batches_add_up_to_the_batch(batch, data):
    loss = _positive_nll_of(batch)
    split = data.draw(rgt.micro_batch_splits(batch.N))
    lp = batch.logprobs.detach().clone().requires_grad_(True)
    batch = batch.replace(logprobs=lp)
    full = loss(batch)
    (grad_full,) = torch.autograd.grad(full, lp)
    summed = sum(rgt.microbatch_losses(loss, batch, split))
    (grad_summed,) = torch.autograd.grad(summed, lp)
    torch.testing.assert_close(summed, full, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_summed, grad_full, rtol=1e-5, atol=1e-6)


def test_positive_nll_ignores_padding_and_row_order():
    few = settings(max_examples=10)
    rgt.assert_padding_invariant(lambda b: _positive_nll_of(b)(b), strict=True, settings=few)
    rgt.assert_group_permutation_equivariant(lambda b: _positive_nll_of(b)(b), contiguous=False, settings=few)


# -- tracing contract ---------------------------------------------------------------------------

N, T = 35, 11


def meta(*shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device="meta")


TOK, SEQ_ADV, MASK = meta(N, T), meta(N, 1), meta(N, T, dtype=torch.bool)


@pytest.mark.parametrize(
    "fn, args, kwargs, outputs",
    [
        (F.ppo_clip, (TOK, TOK, SEQ_ADV, MASK), {"dual_clip": 3.0}, 3),
        (F.gspo, (TOK, TOK, SEQ_ADV, MASK), {}, 3),
        (F.cispo, (TOK, TOK, TOK, MASK), {}, 3),
        (F.gpg_loss, (TOK, TOK, SEQ_ADV, MASK), {}, 3),
        (F.clip_cov, (TOK, TOK, SEQ_ADV, MASK), {}, 3),
        (F.clip_cov, (TOK, TOK, SEQ_ADV, MASK), {"priority": TOK}, 3),
        (F.kl_cov, (TOK, TOK, SEQ_ADV, MASK), {"agg": F.seq_mean_token_sum_norm}, 3),
        (F.value_loss, (TOK, TOK, TOK, MASK), {}, 2),
        (F.value_loss, (TOK, TOK, TOK, MASK), {"clip": None}, 2),
        (F.entropy_bonus, (TOK, MASK), {}, 1),
        (F.positive_token_weight, (MASK, meta(N, dtype=torch.bool)), {}, 1),
        (F.positive_nll, (TOK, MASK, meta(N, dtype=torch.bool), meta()), {}, 1),
    ],
)
def test_runs_on_meta_tensors(fn, args, kwargs, outputs):
    out = op_info(fn).impl(*args, **kwargs)  # what the tracer runs
    outs = out if isinstance(out, tuple) else (out,)
    assert len(outs) == outputs
    assert all(o.shape == () and o.dtype == torch.float32 and o.device.type == "meta" for o in outs)


def test_every_public_function_is_traceable():
    plain = {"LossNormalization", "loss_normalization", "active_loss_normalization", "KL_ESTIMATORS",
             "ESTIMATORS", "estimator", "register_estimator", "get_estimator", "POLICY_LOSS_KL",
             "LOSSES", "register_loss", "get_loss", "UnknownNameError"}  # registries, decorators, names, errors
    for name in F.__all__:
        if name not in plain:
            assert op_info(getattr(F, name)) is not None, name


# -- through the tracer -------------------------------------------------------------------------


def _grpo(agg=None):
    import rlgraph as rg

    @rg.algorithm
    def grpo(state: rg.State, prompts: rg.Prompts, *, n=4):
        ro = rg.generate(state.policy, prompts, n=n)
        rewards = rg.score(state.reward, ro)
        adv = F.group_normalize(rewards, ro.group)

        def loss(lp):
            kwargs = {} if agg is None else {"agg": agg}
            value, clip_fraction, approx_kl = F.ppo_clip(lp, ro.logprobs, adv[:, None], ro.mask, **kwargs)
            return value, {"clip_fraction": clip_fraction, "approx_kl": approx_kl}

        return state.replace(policy=rg.update(state.policy, ro, loss)), {"reward": rewards.mean()}

    return grpo


def test_losses_trace_as_one_node_with_three_scalar_results():
    text = str(_grpo().trace())
    assert "f32[N] = group_normalize" in text
    assert "f32[] = ppo_clip lp" in text and text.count("f32[]") >= 3


def test_the_aggregation_function_passes_through_the_tracer():
    assert "seq_mean_token_mean" in str(_grpo(agg=F.seq_mean_token_mean).trace())
