"""A custom advantage estimator, property-tested, then trained with through `rlgraph train`.

    python examples/custom_estimator.py            # 3 RL steps on the math example's data
    rlgraph train examples/math_grpo/config.yaml --import examples/custom_estimator.py \\
        -o algorithm.hparams.estimator=loo_best_bonus   # the same, from the command line

The estimator is written for one group of `n` rewards; `F.estimator` applies it to every group
and registers it by name, so any algorithm taking `estimator=` can use it.
"""

from __future__ import annotations

import sys
import tempfile

import torch

import rlgraph.testing as rgt
from rlgraph import functional as F


@F.estimator
def loo_best_bonus(r, *, bonus=0.1):                      # r: f32[n], the rewards of one prompt
    baseline = (r.sum() - r) / (r.shape[0] - 1)           # [n] mean of the other samples
    best = (r == r.max()).to(r.dtype)                     # [n] 1 for the group's best samples
    return r - baseline + bonus * best * (r > baseline)   # [n]


def check() -> None:
    """The properties every estimator must have (what `rlgraph check estimator NAME` runs)."""
    def subject(b):
        return loo_best_bonus(b.rewards, b.group, n=b.n)

    groups = rgt.rollout_batches(group_size=(2, 4))
    rgt.assert_group_permutation_equivariant(subject, batches=groups)
    rgt.assert_padding_invariant(subject, batches=groups)
    rewards, group = torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1])
    assert torch.allclose(loo_best_bonus(rewards, group, n=2), torch.tensor([1.1, -1.0, -1.0, 1.1]))


def main(steps: int = 3) -> dict[str, float]:
    from rlgraph.train.config import load_config
    from rlgraph.train.run import train

    check()
    with tempfile.TemporaryDirectory() as run_dir:
        config = load_config("examples/math_grpo/config.yaml", [
            "algorithm.hparams.estimator=loo_best_bonus", f"run_dir={run_dir}", f"train.steps={steps}",
            "warm_start.steps=5", "warm_start.target_accuracy=null", "rollout.prompts_per_step=4", "rollout.n=4",
            "eval.max_prompts=16", "logging.tensorboard=false", "logging.plots=false", "logging.progress=false"])
        result = train(config)
        print(f"trained {result.steps} steps with estimator loo_best_bonus; held-out accuracy "
              f"{result.eval_before:.1%} -> {result.eval_after:.1%}")
    return {"steps": result.steps}


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
