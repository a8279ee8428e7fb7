"""The algorithm library: each algorithm is a short pure function over the primitives."""

from rlgraph.algorithms.agent_grpo import agent_grpo
from rlgraph.algorithms.cispo import cispo
from rlgraph.algorithms.dapo import dapo
from rlgraph.algorithms.distill import distill
from rlgraph.algorithms.dr_grpo import dr_grpo
from rlgraph.algorithms.evaluate import evaluate, evaluate_agent
from rlgraph.algorithms.gkd import gkd
from rlgraph.algorithms.grpo import grpo
from rlgraph.algorithms.gspo import gspo
from rlgraph.algorithms.ppo import ppo
from rlgraph.algorithms.pretrain import pretrain
from rlgraph.algorithms.reinforce_pp import reinforce_pp, reinforce_pp_baseline
from rlgraph.algorithms.remax import remax
from rlgraph.algorithms.rloo import rloo
from rlgraph.algorithms.sft import sft
from rlgraph.algorithms.vapo import vapo

ALGORITHMS = {
    "grpo": grpo, "dr_grpo": dr_grpo, "rloo": rloo, "reinforce_pp": reinforce_pp,
    "reinforce_pp_baseline": reinforce_pp_baseline, "remax": remax, "gspo": gspo, "cispo": cispo, "dapo": dapo,
    "ppo": ppo, "sft": sft, "evaluate": evaluate, "agent_grpo": agent_grpo,
    "distill": distill, "gkd": gkd,  # distillation from frozen teachers (state.teacher)
    "vapo": vapo, "pretrain": pretrain,
}

__all__ = ["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "remax", "gspo", "cispo", "dapo", "ppo", "sft",
           "evaluate", "agent_grpo", "distill", "gkd", "vapo", "pretrain", "ALGORITHMS"]
