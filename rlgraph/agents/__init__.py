"""Multi-turn agents: environments, tools and the episodes a `rg.rollout` builds (docs/agents.md).

A layer beside `rlgraph.data` and `rlgraph.rewards`: it imports `ir`, `rewards` and the batches,
and the backends import it to run an environment's steps between generation turns.
"""

from rlgraph.agents.env import (Env, EnvError, ObservationFormat, OpenEnvAdapter, Step, TextEnvAdapter, TokenEnv,
                                as_token_env)
from rlgraph.agents.tool_env import Call, ToolEnv, parse_hermes, parse_plain
from rlgraph.agents.tools import BUILTIN_TOOLS, Tool, ToolResult, calculate, calculator, python, run_tool, search

__all__ = ["Env", "EnvError", "ObservationFormat", "OpenEnvAdapter", "Step", "TextEnvAdapter", "TokenEnv",
           "as_token_env", "Call", "ToolEnv", "parse_hermes", "parse_plain", "BUILTIN_TOOLS", "Tool", "ToolResult",
           "calculate", "calculator", "python", "run_tool", "search"]
