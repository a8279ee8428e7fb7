"""Shared fixtures-as-functions: a tiny seeded policy, the arithmetic task, an executor."""

import torch

from rlgraph.backends.local.executor import LocalExecutor
from rlgraph.backends.local.models import load_tokenizer
from rlgraph.data import arithmetic
from rlgraph.rewards import exact_match
from rlgraph.testing.tiny import length_parity_reward, tiny_executor, tiny_prompts

TOKENIZER = load_tokenizer()
SPLITS = arithmetic.make_splits(seed=0)


def make_executor(seed: int = 0, lr: float = 1e-3, with_ref: bool = False, max_new_tokens: int = 5,
                  reward=exact_match, critic: bool = False, critic_lr: float = 1e-3) -> LocalExecutor:
    """Policy with AdamW (and optionally a frozen ref and a trainable critic): `rgt.tiny_executor`."""
    roles = ("policy",) + (("ref",) if with_ref else ()) + (("critic",) if critic else ())
    return tiny_executor(roles, seed=seed, lr=lr, optimizer="adamw", critic_lr=critic_lr, reward=reward,
                         max_new_tokens=max_new_tokens)


def prompts(count: int = 4, offset: int = 0):
    return tiny_prompts(count, offset)


def demonstrations(count: int = 16, offset: int = 0):
    return arithmetic.to_demonstrations(SPLITS.train[offset:offset + count], TOKENIZER)


def params_of(executor: LocalExecutor, role: str = "policy") -> list[torch.Tensor]:
    return [p.detach().clone() for p in executor.models[role].model.parameters()]


parity_reward = length_parity_reward  # varies on an untrained model (exact match is all zeros there)


def prompt_source(count: int = 4, offset: int = 100):
    """A fake prompt source for refill loops: successive train batches of `count` from `offset`."""
    drawn = [offset]

    def more():
        drawn[0] += count
        return prompts(count, offset=drawn[0] - count)

    return more


def assert_spmd_resume_is_exact(compiled, world, path, batch, uninterrupted, final) -> None:
    """A checkpoint at `path` resumed on fresh spmd workers gives step `batch` the metrics
    `uninterrupted` and the policy weights `final` of the run that was never stopped, exactly."""
    from rlgraph.runtime.plan_runner import PlanRunner
    from rlgraph.runtime.spmd import SpmdTransport
    from rlgraph.train.checkpoint import load_checkpoint

    with SpmdTransport(compiled.plan, world, device="cpu") as transport:
        resumed = PlanRunner(compiled, transport, controller=world.controller())
        load_checkpoint(path, resumed)
        assert resumed.run(batch)[1] == uninterrupted
        resumed_state = transport.pull_state("policy")
        assert all(torch.equal(resumed_state[name], value) for name, value in final.items())
