"""`rlgraph train` on sources a researcher brings: a saved Hugging Face model directory with a chat
template, chat-format prompts, and rewards that read extra per-row fields (code tests) or run a
model (a reward model), combined with weights, through the compiled plan."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml

from rlgraph.backends.local.models import build_causal_lm, load_tokenizer
from rlgraph.errors import ConfigError, RewardError
from rlgraph.rewards.sandbox import bwrap_failure
from rlgraph.train.config import load_config
from rlgraph.train.run import train

TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};{% endfor %}"
            "{% if add_generation_prompt %}a:{% endif %}")


def saved_model(tmp_path: Path) -> Path:
    """The tiny Qwen2 saved like a downloaded checkpoint: weights, config, tokenizer with a chat template."""
    tokenizer = load_tokenizer(None)
    tokenizer.chat_template = TEMPLATE
    model = build_causal_lm(None, tokenizer=tokenizer, seed=3)
    path = tmp_path / "model"
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def saved_reward_model(tmp_path: Path) -> Path:
    from transformers import AutoModelForSequenceClassification, Qwen2Config

    tokenizer = load_tokenizer(None)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    path = tmp_path / "rm"
    AutoModelForSequenceClassification.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_rows(tmp_path: Path) -> Path:
    rows = [{"messages": [{"role": "user", "content": f"{a}+{b}"}], "answer": str(a + b),
             "tests": [f"assert {a}+{b} == {a + b}", "assert True"]} for a in range(6) for b in range(6)]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def run_config(tmp_path: Path, rewards: list, **extra) -> Path:
    config = {
        "name": "sources", "run_dir": str(tmp_path / "run"),
        "model": {"path": str(saved_model(tmp_path))},
        "data": {"train": str(write_rows(tmp_path)), "prompt_field": "messages", "extra_fields": ["tests"],
                 "eval_fraction": 0.25},
        "rewards": rewards,
        "algorithm": {"name": "grpo", "hparams": {"kl": 0.02}},
        "rollout": {"prompts_per_step": 2, "n": 2, "max_new_tokens": 3},
        "train": {"steps": 2, "seed": 0}, "runtime": {"threads": 1}, "eval": {"every": 0},
        "checkpoint": {"every": 2}, "logging": {"tensorboard": False, "progress": False, "plots": False},
        **extra,
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def rows_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


SANDBOX_FAILURE = bwrap_failure(sys.executable)


@pytest.mark.skipif(SANDBOX_FAILURE is not None, reason=f"the code reward's bubblewrap sandbox cannot run here "
                                                        f"({SANDBOX_FAILURE}); apt-get install bubblewrap")
def test_a_saved_model_with_a_chat_template_and_three_weighted_rewards(tmp_path):
    rm = saved_reward_model(tmp_path)
    path = run_config(tmp_path, [{"name": "math"},
                                 {"name": "code", "weight": 0.5, "options": {"timeout_s": 5}},
                                 {"name": "reward_model", "weight": 0.1, "options": {"path": str(rm)}}])
    result = train(load_config(path))
    assert result.steps == 2
    steps = [row for row in rows_of(tmp_path / "run") if "reward" in row]
    for row in steps:
        # The step reward is the weighted sum of the terms' means (every row weighted alike).
        expected = row["reward/math"] + 0.5 * row["reward/code"] + 0.1 * row["reward/reward_model"]
        assert row["reward"] == pytest.approx(expected, abs=1e-5)
        assert row["reward/errors"] == 0.0 and row["policy/kl"] >= 0.0
        # A completion is 3 characters of digits and symbols: as code it passes "assert True" at least
        # when it is valid Python, never more than both tests.
        assert 0.0 <= row["reward/code"] <= 1.0
    # The policy started from the saved weights (seed 3), not a fresh init with the run's seed 0.
    from safetensors.torch import load_file

    from rlgraph.train.checkpoint import latest_checkpoint

    trained = load_file(str(latest_checkpoint(tmp_path / "run") / "policy.safetensors"))
    saved = build_causal_lm(tmp_path / "model").state_dict()
    fresh = build_causal_lm(None, tokenizer=load_tokenizer(None), seed=0).state_dict()
    name = "model.layers.0.self_attn.q_proj.weight"
    assert (trained[name] - saved[name]).abs().max() < 0.1 * (trained[name] - fresh[name]).abs().max()


def test_a_reward_that_raises_fails_the_run_naming_the_sample_or_is_counted(tmp_path):
    module = tmp_path / "my_rewards.py"
    module.write_text("def broken(completions, **_):\n    raise RuntimeError('reward server down')\n")
    path = run_config(tmp_path, [{"name": "math"}, {"name": f"{module}:broken"}])
    with pytest.raises(RewardError, match=r"reward 'broken' raised RuntimeError: reward server down "
                                          r"\(at .*my_rewards.py:2 in broken\) on sample 0 of \d+ \(prompt 'u:"):
        train(load_config(path))
    zero = run_config(tmp_path, [{"name": "math"}, {"name": f"{module}:broken", "weight": 0.5}],
                      reward_on_error="zero", run_dir=str(tmp_path / "zero"))
    train(load_config(zero))
    steps = [row for row in rows_of(tmp_path / "zero") if "reward" in row]
    assert [row["reward/errors"] for row in steps] == [4.0, 4.0]   # every sample of both steps, counted
    assert all(row["reward"] == pytest.approx(row["reward/math"]) for row in steps)


def test_a_reward_reading_a_field_the_data_does_not_pass_is_refused_before_the_run(tmp_path):
    path = run_config(tmp_path, [{"name": "code"}])
    config = load_config(path, ["data.extra_fields=[]"])
    with pytest.raises(ConfigError, match=r"rewards\[0\] \(code\) reads the per-row field\(s\) tests"):
        train(config)
    assert not (tmp_path / "run").exists()
