"""Reward functions: plain `fn(completions: list[str], **meta) -> list[float]`."""

from rlgraph.rewards.verifiable import REWARDS, RewardFn, exact_match, get_reward

__all__ = ["REWARDS", "RewardFn", "exact_match", "get_reward"]
