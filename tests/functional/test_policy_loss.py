"""`F.policy_loss`: the whole PPO-family loss as one op, equal to its terms, to the fused kernel,
micro-batch invariant, and fused in a compiled run (`fused_policy_loss`)."""

import pytest
import torch
from hypothesis import given, strategies as st

import rlgraph as rg
import rlgraph.functional as F
import rlgraph.testing as rgt
from rlgraph.kernels.policy_loss import policy_loss_reference

AGGREGATIONS = [F.token_mean, F.seq_mean_token_sum, F.seq_mean_token_mean, F.seq_mean_token_sum_norm]


def loss_of(b, agg=F.token_mean, kl="k3"):
    return F.policy_loss(b.logprobs, b.old_logprobs, b.advantages, b.mask, ref_lp=b.ref_logprobs, entropy=b.values.abs(),
                         clip_low=0.2, clip_high=0.28, kl_coef=0.1, kl_estimator=kl, entropy_coef=0.01, agg=agg)


@given(rgt.rollout_batches(), st.sampled_from(AGGREGATIONS), st.sampled_from(["k1", "k2", "k3"]))
def test_equals_ppo_clip_plus_kl_minus_entropy_term_by_term(b, agg, kl):
    value, clip_frac, approx_kl, entropy, kl_mean = loss_of(b, agg, kl)
    pg, want_clip, want_kl = F.ppo_clip(b.logprobs, b.old_logprobs, b.advantages, b.mask, clip_low=0.2, clip_high=0.28, agg=agg)
    kl_tokens = F.KL_ESTIMATORS[kl](torch.where(b.mask, b.logprobs, 0.0), torch.where(b.mask, b.ref_logprobs, 0.0))
    expected = pg + 0.1 * agg(kl_tokens, b.mask) - 0.01 * F.entropy_bonus(b.values.abs(), b.mask, agg=agg)
    torch.testing.assert_close(value, expected)
    torch.testing.assert_close((clip_frac, approx_kl), (want_clip, want_kl))
    torch.testing.assert_close(kl_mean, F.token_mean(kl_tokens, b.mask))


@given(rgt.rollout_batches(), st.sampled_from(AGGREGATIONS), st.sampled_from(["k1", "k2", "k3"]))
def test_matches_the_fused_kernels_torch_reference_with_gradients(b, agg, kl):
    lp = b.logprobs.clone().requires_grad_(True)
    ours = loss_of(b.replace(logprobs=lp), agg, kl)
    lp_ref = b.logprobs.clone().requires_grad_(True)
    theirs = policy_loss_reference(lp_ref, b.old_logprobs, b.advantages, b.mask, ref_lp=b.ref_logprobs,
                                   entropy=b.values.abs(), clip_low=0.2, clip_high=0.28, kl_coef=0.1, kl_estimator=kl,
                                   entropy_coef=0.01, agg=agg)
    for a, e in zip(ours, theirs):
        torch.testing.assert_close(a.detach(), e.detach(), rtol=1e-5, atol=1e-5)
    (grad,), (grad_ref,) = torch.autograd.grad(ours[0], [lp]), torch.autograd.grad(theirs[0], [lp_ref])
    torch.testing.assert_close(grad, grad_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("agg", AGGREGATIONS, ids=lambda agg: agg.__name__)
def test_micro_batch_invariant(agg):
    rgt.assert_microbatch_invariant(lambda b: loss_of(b, agg))


def test_an_unsupported_kl_estimator_is_refused_with_the_alternative():
    b = rgt.RolloutBatch.of(group=[0], mask=[[True]])
    with pytest.raises(ValueError, match=r"kl_estimator must be one of .*F\.kl_abs"):
        F.policy_loss(b.logprobs, b.old_logprobs, b.advantages, b.mask, ref_lp=b.ref_logprobs, kl_estimator="abs")


@rg.algorithm
def grpo_kl_entropy(state: rg.State, prompts: rg.Prompts, *, n=2, kl=0.05, max_new_tokens=3, micro_batch_size=None):
    ro = rg.generate(state.policy, prompts, n=n, max_new_tokens=max_new_tokens)
    r = rg.score(state.reward, ro)
    adv = F.group_normalize(r, ro.group)[:, None]
    ref = rg.logprobs(state.ref, ro)

    def loss(lp, entropy):
        value, clip_frac, approx_kl, mean_entropy, mean_kl = F.policy_loss(
            lp, ro.logprobs, adv, ro.mask, ref_lp=ref, entropy=entropy, kl_coef=kl, entropy_coef=0.01)
        return value, {"clip_frac": clip_frac, "kl": mean_kl, "entropy": mean_entropy}

    policy = rg.update(state.policy, ro, loss, micro_batch_size=micro_batch_size)
    return state.replace(policy=policy), {"reward": r.mean()}


@pytest.mark.parametrize("micro", [None, 2])
def test_a_compiled_run_fuses_the_whole_loss_and_matches_eager(micro):
    compiled = rg.compile(grpo_kl_entropy, mesh="cpu:1", placement=rg.colocated(offload=False, checkpointing=False),
                          sizes={"B": 2, "P": 8, "T": 3}, micro_batch_size=micro)
    assert "fused_policy_loss (in loss)" in compiled.as_text()
    metrics = rgt.assert_compiled_matches_eager(grpo_kl_entropy, executor=lambda: rgt.tiny_executor(("policy", "ref")),
                                                batches=[rgt.tiny_prompts(2, offset=2 * i) for i in range(2)],
                                                sizes={"B": 2, "P": 8, "T": 3}, micro_batch_size=micro)
    assert metrics[1]["policy/kl"] > 0 and metrics[0]["policy/entropy"] > 0
