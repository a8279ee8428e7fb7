"""Shared fixtures-as-functions: a tiny seeded policy, the arithmetic task, an executor."""

import torch

from rlgraph.backends.local.critic import build_critic
from rlgraph.backends.local.executor import LMWorker, LocalExecutor, RewardWorker
from rlgraph.backends.local.models import build_causal_lm, load_tokenizer
from rlgraph.data import arithmetic
from rlgraph.rewards import exact_match

TOKENIZER = load_tokenizer()
SPLITS = arithmetic.make_splits(seed=0)


def make_executor(seed: int = 0, lr: float = 1e-3, with_ref: bool = False, max_new_tokens: int = 5,
                  reward=exact_match, critic: bool = False, critic_lr: float = 1e-3) -> LocalExecutor:
    """Policy (and optionally a frozen ref and a trainable critic, `build_critic` seeded seed+1)."""
    model = build_causal_lm(tokenizer=TOKENIZER, seed=seed)
    models = {"policy": LMWorker(model, torch.optim.AdamW(model.parameters(), lr=lr))}
    if with_ref:
        ref = build_causal_lm(tokenizer=TOKENIZER, seed=seed)
        models["ref"] = LMWorker(ref)
    if critic:
        value_model = build_critic(tokenizer=TOKENIZER, seed=seed + 1)
        models["critic"] = LMWorker(value_model, torch.optim.AdamW(value_model.parameters(), lr=critic_lr), kind="critic")
    return LocalExecutor(models, {"reward": RewardWorker(reward)}, TOKENIZER, max_new_tokens=max_new_tokens, seed=seed)


def prompts(count: int = 4, offset: int = 0):
    return arithmetic.to_prompts(SPLITS.train[offset:offset + count], TOKENIZER)


def demonstrations(count: int = 16, offset: int = 0):
    return arithmetic.to_demonstrations(SPLITS.train[offset:offset + count], TOKENIZER)


def params_of(executor: LocalExecutor, role: str = "policy") -> list[torch.Tensor]:
    return [p.detach().clone() for p in executor.models[role].model.parameters()]


def parity_reward(completions, **_):
    """A reward that varies on an untrained model (exact match is all zeros there)."""
    return [float(len(text) % 2) for text in completions]


def prompt_source(count: int = 4, offset: int = 100):
    """A fake prompt source for refill loops: successive train batches of `count` from `offset`."""
    drawn = [offset]

    def more():
        drawn[0] += count
        return prompts(count, offset=drawn[0] - count)

    return more
