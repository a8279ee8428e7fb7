"""The standard per-step metrics (`rlgraph.algorithms.metrics`): present in a real step, right values."""

import copy
import functools

import pytest
import torch

import rlgraph as rg
import rlgraph.testing as rgt
from rlgraph.algorithms import cispo, dapo, dr_grpo, grpo, gspo, ppo, reinforce_pp, reinforce_pp_baseline, remax, rloo
from rlgraph.algorithms.metrics import rollout_stats
from rlgraph.backends.local.logprobs import sequence_logprobs
from rlgraph.runtime.eager import Interpreter
from tests.algorithms._steps import two_steps
from tests.helpers import make_executor, parity_reward, prompt_source, prompts

ROLLOUT_KEYS = {"reward", "reward/std", "response_length/mean", "response_length/max", "response_length/clip_frac"}
LOSS_KEYS = {"policy/clip_frac", "policy/approx_kl", "policy/logprob_diff", "policy/entropy"}


def recording(executor):
    """`executor`, with the rollouts of its `generate` calls and the scores of its `score` calls kept."""
    seen = {"generate": [], "score": []}
    for name, kept in seen.items():
        def record(*args, _method=getattr(executor, name), _kept=kept, **kwargs):
            _kept.append(_method(*args, **kwargs))
            return _kept[-1]
        setattr(executor, name, record)
    return executor, seen


def one_step(algorithm, executor, **hparams):
    """One eager step on 3 prompts: (metrics, the rollouts, the scores)."""
    executor, seen = recording(executor)
    _, metrics = Interpreter(executor).run(algorithm.trace(**hparams), prompts(3), more_prompts=prompt_source(3))
    return metrics, seen["generate"][0], seen["score"][0]


def test_a_grpo_step_reports_the_standard_metrics_with_their_values():
    executor = make_executor(with_ref=True, reward=parity_reward, max_new_tokens=4)
    before = copy.deepcopy(executor.models["policy"].model)  # the weights the loss's forward saw
    metrics, ro, r = one_step(grpo, executor, n=4, kl=0.1)
    assert ROLLOUT_KEYS | LOSS_KEYS | {"policy/kl"} <= metrics.keys()
    length = ro.mask.sum(-1).float()                                   # [N]
    assert metrics["reward"] == pytest.approx(r.mean().item())
    assert metrics["reward/std"] == pytest.approx(torch.std(r).item())  # Bessel-corrected, as torch.std
    assert torch.std(r).item() != pytest.approx(torch.std(r, correction=0).item())  # the test tells them apart
    assert metrics["response_length/mean"] == pytest.approx(length.mean().item())
    assert metrics["response_length/max"] == length.max().item()
    assert metrics["response_length/clip_frac"] == pytest.approx((length == ro.mask.shape[1]).float().mean().item())
    assert metrics["policy/kl"] < 1e-10                                # policy == reference before the first step
    assert metrics["policy/logprob_diff"] < 1e-5                       # on-policy, fp32 CPU: sampler == trainer
    _, entropy = sequence_logprobs(before.train(), ro, with_entropy=True)  # [N, T]
    assert metrics["policy/entropy"] == pytest.approx((entropy.sum() / ro.mask.sum()).item(), rel=1e-5)
    assert metrics["policy/entropy"] > 0.1


def test_the_rollout_statistics_at_their_edges():
    mask = torch.tensor([[True, True, True], [True, False, False]])   # one response fills T = 3, one stops at 1
    mean, std, length, longest, clipped = rollout_stats(torch.tensor([1.0, 0.0]), mask)
    assert (mean.item(), longest.item(), clipped.item(), length.item()) == (0.5, 3.0, 0.5, 2.0)
    assert std.item() == pytest.approx(2 ** -0.5)                      # Bessel: sqrt(0.5 / (2 - 1))
    assert rollout_stats(torch.tensor([0.7]), mask[:1])[1].item() == 0.0  # one score: 0, not torch.std's NaN


def test_logprob_diff_also_measures_the_policys_own_movement_after_the_first_optimizer_step():
    one_epoch = one_step(grpo, make_executor(reward=parity_reward, max_new_tokens=4), n=4)[0]
    two_epochs = one_step(grpo, make_executor(reward=parity_reward, max_new_tokens=4), n=4, epochs=2)[0]
    assert one_epoch["policy/logprob_diff"] < 1e-5 < two_epochs["policy/logprob_diff"]


KL_IN_THE_LOSS = {"policy/kl"}
KL_IN_THE_REWARD = {"ref_kl"}


@pytest.mark.parametrize("algorithm, hparams, with_ref, extra", [
    (grpo, dict(n=4), False, set()),
    (grpo, dict(n=4, kl=0.05, tis_cap=2.0), True, KL_IN_THE_LOSS | {"logprob_mismatch/mean", "logprob_mismatch/max"}),
    (dapo, dict(n=4, max_new_tokens=4, overlong_buffer=1), False, {"shaped_reward", "filter/rounds"}),
    (dr_grpo, dict(n=4), False, set()),
    (rloo, dict(n=4), False, set()),
    (reinforce_pp, dict(kl=0.05), True, KL_IN_THE_REWARD),
    (reinforce_pp_baseline, dict(kl=0.05), True, KL_IN_THE_LOSS),
    (remax, dict(n=2), False, {"greedy_reward"}),
    (gspo, dict(n=4), False, set()),
    (cispo, dict(n=4), False, set()),
    (ppo, dict(kl=0.05), True, KL_IN_THE_REWARD | {"value", "critic/clip_frac"}),
    (ppo, dict(kl=0.05, kl_target=0.02), True, KL_IN_THE_REWARD | {"kl_coef", "value"}),
], ids=lambda value: getattr(value, "name", None))
def test_every_policy_gradient_algorithm_reports_them(algorithm, hparams, with_ref, extra):
    executor = make_executor(with_ref=with_ref, reward=parity_reward, max_new_tokens=4, critic=algorithm is ppo)
    _, metrics = two_steps(algorithm, executor=executor, **hparams)
    assert ROLLOUT_KEYS | LOSS_KEYS | extra <= metrics.keys()
    assert ("policy/kl" in metrics) == ("policy/kl" in extra)          # only where the loss has a KL term
    assert 0.0 <= metrics["response_length/clip_frac"] <= 1.0 and metrics["policy/entropy"] > 0.0


def test_the_compiled_plan_computes_them_with_the_loss_still_fused():
    """Metric nodes are plan nodes: the plan runner gives the eager numbers, and `ppo_clip` stays fused."""
    sizes, hparams = {"B": 4, "P": 8, "T": 4}, dict(n=4, max_new_tokens=4, kl=0.05)
    compiled = rg.compile(grpo, mesh="cpu:1", placement=rg.colocated(offload=False, checkpointing=False),
                          sizes=sizes, **hparams)
    text = compiled.as_text()
    assert "kernels: fused_ppo_clip (in loss)" in text and "rollout_stats=rollout_stats" in text
    executor = functools.partial(rgt.tiny_executor, ("policy", "ref"))
    metrics = rgt.assert_compiled_matches_eager(grpo, executor=executor, batches=[prompts(4), prompts(4, offset=4)],
                                                sizes=sizes, **hparams)
    assert all(ROLLOUT_KEYS | LOSS_KEYS | {"policy/kl"} <= step.keys() for step in metrics)


def test_the_loss_side_metrics_do_not_depend_on_the_micro_batch_size():
    """token means under the mini-batch's global counts: the micro-batches' pieces add up to the whole."""
    rgt.assert_update_microbatch_invariant(grpo, executor=functools.partial(rgt.tiny_executor, ("policy", "ref")),
                                           batches=[prompts(4)], n=4, max_new_tokens=4, kl=0.05)
