"""`train.compile` resolved for a run (`rlgraph.train.roles.compiles_training`)."""

from __future__ import annotations

import pytest

from rlgraph.backends.local.train_compile import AUTO_MIN_FORWARDS
from rlgraph.errors import ConfigError
from rlgraph.train.roles import compiles_training
from tests.train.test_run import make_config


def test_auto_counts_the_runs_training_forwards(tmp_path):
    # 4 prompts x n=4 = 16 rows a step, one micro-batch: AUTO_MIN_FORWARDS steps reach the break-even, one less does not
    long, _ = make_config(tmp_path, "long", [f"train.steps={AUTO_MIN_FORWARDS}"])
    short, _ = make_config(tmp_path, "short", [f"train.steps={AUTO_MIN_FORWARDS - 1}"])
    assert compiles_training(long, "cpu") and not compiles_training(short, "cpu")
    # micro-batches of 4 rows: 4 forwards a step, so a quarter of the steps reach it
    micro, _ = make_config(tmp_path, "micro", [f"train.steps={AUTO_MIN_FORWARDS // 4}",
                                               "algorithm.hparams={kl: 0.04, micro_batch_size: 4}"])
    assert compiles_training(micro, "cpu")
    # two epochs of 4 micro-batches: 8 forwards a step
    epochs, _ = make_config(tmp_path, "epochs", [f"train.steps={AUTO_MIN_FORWARDS // 8 - 1}",
                                                 "algorithm.hparams={kl: 0.04, micro_batch_size: 4, epochs: 2}"])
    assert not compiles_training(epochs, "cpu")
    seconds, _ = make_config(tmp_path, "seconds", ["train.steps=null", "train.seconds=60"])
    assert not compiles_training(seconds, "cpu")
    assert not compiles_training(long, "cuda")


def test_on_and_off_are_taken_as_said(tmp_path):
    on, _ = make_config(tmp_path, "on", ["train.compile=on"])
    off, _ = make_config(tmp_path, "off", ["train.compile=off", "train.steps=100000"])
    assert compiles_training(on, "cpu") and not compiles_training(off, "cpu")


def test_compile_on_off_the_local_runtime_is_refused_naming_both_keys(tmp_path):
    config, _ = make_config(tmp_path, "spmd", ["train.compile=on", "runtime.runtime=spmd", "runtime.nproc=2"])
    with pytest.raises(ConfigError, match="train.compile=on with runtime.runtime=spmd"):
        compiles_training(config, "cpu")


@pytest.mark.parametrize("override", ["train.compile=yes", "train.compile=true", "train.compile=1"])
def test_bad_compile_values_name_the_key(tmp_path, override):
    with pytest.raises(ConfigError, match=r"train.compile: Input should be 'auto', 'on' or 'off'"):
        make_config(tmp_path, "bad", [override])
