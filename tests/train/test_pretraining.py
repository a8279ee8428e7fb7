import json

import pytest
import torch

from rlgraph.errors import ConfigError
from rlgraph.train.checkpoint import latest_checkpoint, read_checkpoint
from rlgraph.train.config import load_config
from rlgraph.train.run import load_run_config, train

DOCUMENTS = ["the cat sat on the mat", "one two three four five", "a river runs to the sea"]


def config_of(tmp_path, name, *overrides):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in DOCUMENTS))
    base = {"name": name, "run_dir": str(tmp_path / name), "algorithm": {"name": "pretrain"},
            "data": {"train": str(corpus)}, "pretrain": {"seq_len": 12, "packs_per_step": 2},
            "optimizer": {"name": "adamw", "lr": 1e-2}, "train": {"steps": 4, "seed": 0},
            "runtime": {"threads": 1}, "checkpoint": {"every": 2, "keep_last": 3},
            "logging": {"tensorboard": False, "plots": False, "progress": False}}
    return load_config(None, list(overrides), base=base)


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def weights(run_dir):
    state, step, _ = read_checkpoint(latest_checkpoint(run_dir))
    return step, dict(state.roles["policy"].model)


def test_a_resumed_run_continues_mid_epoch_exactly_and_the_loss_falls(tmp_path):
    straight = train(config_of(tmp_path, "straight")).run_dir
    cut = train(config_of(tmp_path, "cut", "train.steps=2")).run_dir
    train(load_run_config(cut, ["train.steps=4"]), resume=True)
    (step_a, a), (step_b, b) = weights(straight), weights(cut)
    assert step_a == step_b == 4 and all(torch.equal(a[name], b[name]) for name in a)
    whole, resumed = rows(straight), rows(cut)
    assert [row["nll"] for row in whole] == [row["nll"] for row in resumed]
    assert [row["epoch"] for row in whole] == [0.0, 0.0, 1.0, 1.0]  # 23 + 24 + 24 tokens an epoch (EOS included), 24 a step
    assert whole[-1]["nll"] < whole[0]["nll"] and whole[0]["perplexity"] > whole[-1]["perplexity"] > 1.0
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["last_loss"] == whole[-1]["nll"] and summary["tokens_per_step"] == 24
    assert "pretrain" in (straight / "plan.txt").read_text()


def test_a_resume_with_another_packing_is_refused(tmp_path):
    cut = train(config_of(tmp_path, "cut", "train.steps=2")).run_dir
    with pytest.raises(Exception, match="written by another run.*pretrain: checkpoint"):
        train(load_run_config(cut, ["train.steps=4", "pretrain.seq_len=10"]), resume=True)


@pytest.mark.parametrize("override, message", [
    ("runtime.runtime=spmd", "runtime.runtime=spmd"),
    ("warm_start.steps=5", "warm_start.steps=5"),
    ("rollout.staleness=1", "rollout.staleness=1"),
])
def test_what_pretraining_cannot_take_is_refused_before_anything_runs(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        train(config_of(tmp_path, "bad", override))
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("override", ["pretrain.seq_len=0", "pretrain.packs_per_step=-1", "pretrain.seq_len=ten"])
def test_bad_packing_values_are_config_errors_naming_the_key(tmp_path, override):
    with pytest.raises(ConfigError, match=override.split("=")[0]):
        config_of(tmp_path, "bad", override)


def test_rl_algorithms_still_need_a_reward(tmp_path):
    with pytest.raises(ConfigError, match="rewards: algorithm 'grpo' scores its samples"):
        config_of(tmp_path, "bad", "algorithm.name=grpo")


def test_a_pretraining_run_keeps_the_run_directory_rule(tmp_path):
    """As every run: a fresh run into a directory holding the user's files is refused unless overwrite, and
    the files it writes are recorded in the manifest (so a later resume deletes only those)."""
    from rlgraph.train.manifest import owns

    config = config_of(tmp_path, "mine", "train.steps=1", "checkpoint.every=1")
    config.directory.mkdir(parents=True)
    (config.directory / "notes.txt").write_text("the user's")
    with pytest.raises(ConfigError, match="holds files rlgraph did not write \\(notes.txt\\)"):
        train(config)
    run_dir = train(config, overwrite=True).run_dir
    assert (run_dir / "notes.txt").read_text() == "the user's"
    assert all(owns(run_dir, name) for name in ("config.yaml", "plan.txt", "metrics.jsonl", "summary.json", "step-000001"))
    assert not owns(run_dir, "notes.txt")
