"""docs/tutorials/train-your-model.md: its config is a valid `rlgraph train` config and its rewards build."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from rlgraph.train.config import load_config
from rlgraph.train.user_code import build_rewards

TUTORIAL = Path(__file__).resolve().parents[2] / "docs" / "tutorials" / "train-your-model.md"


def test_the_tutorial_config_is_valid_and_its_rewards_build(tmp_path):
    block = re.search(r"```yaml\n(.*?)```", TUTORIAL.read_text(), re.DOTALL).group(1)
    path = tmp_path / "gsm8k.yaml"
    path.write_text(block)
    config = load_config(path)
    assert config.model.lora is not None and config.model.lora.r == 16
    assert config.algorithm.hparams["kl"] == 0.04 and config.optimizer.schedule == "cosine"
    rewards = build_rewards(config)
    scores = rewards(["<think>48 + 24</think> so \\boxed{72}", "72"], answer=["... #### 72", "72"], text=["q", "q"])
    assert scores == [1.1, 1.0]
    assert yaml.safe_load(block)["data"]["system_prompt"].endswith("\\boxed{}.")
