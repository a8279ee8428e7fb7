"""The algorithm library: each algorithm is a short pure function over the primitives."""

from rlgraph.algorithms.evaluate import evaluate
from rlgraph.algorithms.grpo import grpo
from rlgraph.algorithms.sft import sft

ALGORITHMS = {"grpo": grpo, "sft": sft, "evaluate": evaluate}

__all__ = ["grpo", "sft", "evaluate", "ALGORITHMS"]
