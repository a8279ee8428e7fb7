"""rlgraph: write an RL algorithm as a typed dataflow graph, inspect the compiled plan, run it."""

from rlgraph.api import Algorithm, Env, State, Step, Tool, ToolEnv, algorithm, compile, critic, env, lm, reward_fn, roles
from rlgraph.batches import Prompts, Rollouts
from rlgraph.ir import Program, RLGraphError, SpecError, TraceError, VerifyError, traceable
from rlgraph.ir.columns import column
from rlgraph.ir.primitives import (EPISODE_FIELDS, filter_groups, generate, logprobs, optimizer_step, rollout, score,
                                   update, values)
from rlgraph.plan.mesh import Mesh, colocated, explicit, split
from rlgraph.functional.estimator import estimator

__all__ = [
    "Algorithm", "State", "algorithm", "compile", "estimator", "Mesh", "colocated", "split", "explicit", "critic", "lm", "reward_fn", "roles", "Prompts", "Rollouts",
    "Program", "RLGraphError", "SpecError", "TraceError", "VerifyError", "traceable",
    "filter_groups", "generate", "logprobs", "score", "update", "values", "optimizer_step", "column",
    "Env", "Step", "Tool", "ToolEnv", "env", "rollout", "EPISODE_FIELDS",
]
__version__ = "0.1.0"
