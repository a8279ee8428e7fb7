"""A custom reward: any `fn(completions, **row_fields) -> list[float]`, named in the config as
`"examples/custom_reward.py:short_and_right"` and weighted against a library reward.

    python examples/custom_reward.py

The row fields are the dataset's answer (`answer`), the prompt text (`text`) and any
`data.extra_fields`. A reward that raises, returns NaN or the wrong number of scores fails the
run naming the sample (`reward_on_error: fail`), or scores 0 and is counted (`zero`).
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence


def short_and_right(completions: Sequence[str], answer: Sequence[str], **_) -> list[float]:
    """1 for the exact answer, minus 0.1 per character beyond it (a brevity preference)."""
    scores = []
    for completion, expected in zip(completions, answer):
        text = completion.strip()
        right = float(text.startswith(expected))
        scores.append(right - 0.1 * max(len(text) - len(expected), 0))
    return scores


def main(steps: int = 3) -> dict[str, float]:
    from rlgraph.train.config import load_config
    from rlgraph.train.run import train

    assert short_and_right(["12", "123", "9"], answer=["12", "12", "12"]) == [1.0, 0.9, 0.0]
    with tempfile.TemporaryDirectory() as run_dir:
        config = load_config("examples/math_grpo/config.yaml", [
            "rewards=[{name: 'examples/custom_reward.py:short_and_right', weight: 1.0}, {name: math, weight: 0.5}]",
            f"run_dir={run_dir}", f"train.steps={steps}", "warm_start.steps=5", "warm_start.target_accuracy=null",
            "rollout.prompts_per_step=4", "rollout.n=4", "eval.max_prompts=16", "eval.accuracy_reward=math",
            "logging.tensorboard=false", "logging.plots=false", "logging.progress=false"])
        result = train(config)
        print(f"trained {result.steps} steps on 1.0 x short_and_right + 0.5 x math")
    return {"steps": result.steps}


if __name__ == "__main__":
    main()
