import torch

from rlgraph.algorithms import ppo
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
