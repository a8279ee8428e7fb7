"""Supervised worker processes (`pool.py`: the controller's side; `process.py`: the worker's), shared
by the reward pool (`rlgraph.rewards.reward_pool`) and the environment workers of multi-turn rollouts
(`rlgraph.agents.workers`)."""

from rlgraph.supervised.pool import BuildError, PoolNames, SupervisedPool, pid_namespace_failure, resolve_isolation

__all__ = ["BuildError", "PoolNames", "SupervisedPool", "pid_namespace_failure", "resolve_isolation"]
