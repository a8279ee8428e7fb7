"""The update's forward under torch.compile (`rlgraph.backends.local.train_compile`): the same
step as eager, and `train.compile: auto` (off for now)."""

from __future__ import annotations

import pytest
import torch

from rlgraph.backends.local.train_compile import resolve_train_compile
from rlgraph.errors import ConfigError
from rlgraph.runtime.eager import Interpreter
from rlgraph.testing.tiny import tiny_executor
from tests.backends.test_packing import clipped_surrogate, ragged_rollouts


@pytest.mark.parametrize("mode, expected", [("on", True), ("off", False), ("auto", False)])
def test_on_compiles_and_auto_stays_eager_until_the_bench_recompiles_are_bounded(mode, expected):
    assert resolve_train_compile(mode) is expected


@pytest.mark.parametrize("bad", ["yes", "ON", True, None])
def test_a_bad_mode_is_named(bad):
    with pytest.raises(ConfigError, match=f"train.compile={bad!r} is not one of 'auto', 'on', 'off'"):
        resolve_train_compile(bad)


@pytest.mark.slow
def test_the_compiled_update_equals_the_eager_one():
    """One micro-batch shape (two micro-batches of 3 rows), so one Inductor compile (~1 min on a
    loaded 2-core machine). Inductor may fuse and reorder fp32 arithmetic: metrics within rel 1e-5,
    weights after the SGD step within 1e-6 (observed: ~1e-8)."""
    batch = ragged_rollouts([6, 2, 4, 1, 5, 3], [7, 1, 0, 5, 3, 7], 6, 7, seed=3)
    runs = []
    for compiled in (False, True):
        executor = tiny_executor(lr=0.1)
        executor.compile_train = compiled
        metrics = Interpreter(executor).run(clipped_surrogate.trace(micro_batch_size=3), batch)[1]
        runs.append((metrics, [p.detach().clone() for p in executor.models["policy"].model.parameters()]))
    (eager, eager_weights), (compiled, compiled_weights) = runs
    assert compiled.keys() == eager.keys()
    for key, value in eager.items():
        assert compiled[key] == pytest.approx(value, rel=1e-5), key
    for mine, theirs in zip(compiled_weights, eager_weights):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)
