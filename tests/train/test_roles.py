"""`train.compile` resolved for a run (`rlgraph.train.roles.compiles_training`)."""

from __future__ import annotations

import pytest

from rlgraph.ir.errors import ConfigError
from rlgraph.train.roles import compiles_training
from tests.train.test_run import make_config


def test_auto_stays_eager_however_long_the_run(tmp_path):
    # auto is off until the recompiles measured in `rlgraph bench` are bounded (train_compile's docstring)
    long, _ = make_config(tmp_path, "long", ["train.steps=100000"])
    assert not compiles_training(long, "cpu") and not compiles_training(long, "cuda")


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
