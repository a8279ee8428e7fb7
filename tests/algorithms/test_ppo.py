import math

import pytest
import torch

from rlgraph.algorithms import ppo
from rlgraph.runtime.eager import Interpreter
from tests.algorithms._steps import two_steps
from tests.helpers import make_executor, params_of, parity_reward, prompts


def executor_with_critic():
    return make_executor(with_ref=True, reward=parity_reward, max_new_tokens=4, critic=True)


def test_ppo_trains_the_policy_and_the_critic_for_two_steps():
    executor = executor_with_critic()
    critic_before = params_of(executor, "critic")
    text, metrics = two_steps(ppo, executor=executor, n=2, kl=0.05, max_new_tokens=4)
    for op in ("values critic", "gae[gamma=1.0 lam=0.95]", "masked_whiten", "kl_k1", "ppo_clip", "value_loss[clip=0.5]"):
        assert op in text, op
    assert executor.current("critic").version == 2
    assert metrics["critic/loss"] > 0 and metrics["critic/grad_norm"] > 0 and "critic/clip_frac" in metrics
    assert "policy/clip_frac" in metrics and "value" in metrics
    assert any(not torch.equal(a, b) for a, b in zip(critic_before, params_of(executor, "critic")))


def test_critic_values_are_per_response_token_zero_when_masked_and_differentiable():
    executor = executor_with_critic()
    rollouts = executor.generate(executor.current("policy"), prompts(2), n=2)
    values = executor.models["critic"].model.values(rollouts)
    assert values.shape == rollouts.mask.shape and values.requires_grad
    assert torch.all(values[~rollouts.mask] == 0) and torch.all(values[rollouts.mask] != 0)


def test_minibatches_split_both_updates():
    executor = executor_with_critic()
    text, metrics = two_steps(ppo, executor=executor, n=2, minibatches=2, max_new_tokens=4)
    assert text.count("update[epochs=1 minibatches=2") == 2
    assert executor.current("critic").version == 2 and metrics["critic/grad_norm"] > 0


# -- adaptive KL controller: a scalar carried in the state ------------------------------------------


def test_adaptive_kl_coef_by_hand():
    import rlgraph.functional as F

    kl = torch.tensor([[0.3, 0.1, 9.0], [0.2, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])  # row KL means 0.2 and 0.2: KL = 0.2
    assert F.adaptive_kl_coef(torch.tensor(0.1), kl, mask, target=0.1, horizon=10).item() == pytest.approx(0.1 * (1 + 0.2 * 2 / 10))
    assert F.adaptive_kl_coef(torch.tensor(0.1), kl, mask, target=0.19, horizon=10).item() == pytest.approx(
        0.1 * (1 + (0.2 / 0.19 - 1) * 2 / 10))
    with pytest.raises(ValueError, match="target and horizon must be > 0"):
        F.adaptive_kl_coef(torch.tensor(0.1), kl, mask, target=0.0, horizon=10)


def adaptive_steps(interpreter, program, steps, offset=0):
    return [interpreter.run(program, prompts(2, offset=2 * (offset + i)))[1] for i in range(steps)]


def test_the_adaptive_coefficient_is_carried_from_step_to_step():
    # A target far above any KL: the error clips at -0.2, so beta shrinks by 1 - 0.2 N / horizon per step.
    program = ppo.trace(n=2, kl=0.05, kl_target=1e6, kl_horizon=10, max_new_tokens=4)
    assert "kl_coef:f32[]" in str(program) and "kl_coef=" in str(program).split("in (state{")[1]
    interpreter = Interpreter(executor_with_critic())
    metrics = adaptive_steps(interpreter, program, 3)
    shrink = 1 - 0.2 * 4 / 10  # N = 2 prompts x n = 2
    assert [m["kl_coef"] for m in metrics] == pytest.approx([0.05, 0.05 * shrink, 0.05 * shrink ** 2])
    assert all(math.isfinite(m["ref_kl"]) for m in metrics)  # k1 is unbiased, so a batch mean may be < 0


def test_the_carried_coefficient_is_checkpointed_and_resumes_exactly(tmp_path):
    from rlgraph.runtime.runner import EagerRunner
    from rlgraph.train.loop import Trainer

    def trainer():
        batches = iter(range(100))
        return Trainer(EagerRunner(ppo.trace(n=2, kl=0.05, kl_target=1e6, kl_horizon=10, max_new_tokens=4),
                                   executor_with_critic()), lambda: prompts(2, offset=2 * next(batches)), run_dir=tmp_path)

    straight = trainer()
    history = list(straight.run(steps=3))
    first = trainer()
    list(first.run(steps=2))
    first.save()
    resumed = trainer()
    assert resumed.resume() and resumed.runner.carried["kl_coef"].item() == pytest.approx(history[2]["kl_coef"])


def test_compiled_adaptive_ppo_matches_eager():
    import rlgraph.testing as rgt

    rgt.assert_compiled_matches_eager(
        ppo, executor=lambda: rgt.tiny_executor(("policy", "ref", "critic")), batches=[prompts(2, offset=2 * i) for i in range(3)],
        sizes={"B": 2, "P": 8, "T": 4}, n=2, kl=0.05, kl_target=0.01, kl_horizon=10, max_new_tokens=4)


def test_carried_values_are_checked_while_tracing():
    import rlgraph as rg

    @rg.algorithm
    def bad_replace(state: rg.State, prompts: rg.Prompts):
        beta = state.carry("beta", init=0.1)
        ro = rg.generate(state.policy, prompts)
        return state.replace(beta=beta * ro.logprobs), {"beta": beta}  # E-shape

    with pytest.raises(rg.TraceError, match=r"the carried value 'beta' is f32\[\], got f32\[B,T\]") as exc:
        bad_replace.trace()
    assert "E-shape" in str(exc.value)

    @rg.algorithm
    def undeclared(state: rg.State, prompts: rg.Prompts):
        ro = rg.generate(state.policy, prompts)
        return state.replace(beta=ro.logprobs.mean()), {}

    with pytest.raises(rg.TraceError, match=r"fix: declare a carried scalar first: state.carry\('beta', init=...\)"):
        undeclared.trace()

    @rg.algorithm
    def traced_init(state: rg.State, prompts: rg.Prompts):
        ro = rg.generate(state.policy, prompts)
        state.carry("beta", init=ro.logprobs.mean())
        return state, {}

    with pytest.raises(rg.TraceError, match="init must be a number"):
        traced_init.trace()


def test_tis_cap_recomputes_old_logprobs_for_the_ratio_and_the_kl_and_reports_the_mismatch():
    text, metrics = two_steps(ppo, executor=executor_with_critic(), n=2, kl=0.05, max_new_tokens=4, tis_cap=2.0)
    assert "truncated_is_weights[cap=2.0]" in text
    old = text.split(" = logprobs[temperature=1.0 entropy=False] policy a")[0].split()[-1].split(":")[0]  # its name
    assert f"= kl_k1 {old} " in text and f"ppo_clip[clip_low=0.2] lp {old} " in text  # trainer's old log-probs
    assert 0.0 <= metrics["logprob_mismatch/mean"] <= metrics["logprob_mismatch/max"] < 1e-4  # fp32: no mismatch
