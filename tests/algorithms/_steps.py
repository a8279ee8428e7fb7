"""Shared check for the algorithm tests: trace, read the program, run two eager steps."""

import math

import torch

from rlgraph.backends.protocols import ModelRef
from rlgraph.runtime.eager import Interpreter
from tests.helpers import make_executor, params_of, parity_reward, prompt_source, prompts


def two_steps(algorithm, *, executor=None, role="policy", count=3, with_ref=False, **hparams):
    """Two iterations on the tiny model and the parity reward; returns (program text, last metrics)."""
    program = algorithm.trace(**hparams)
    executor = executor or make_executor(with_ref=with_ref, reward=parity_reward, max_new_tokens=4)
    interpreter, before, grad_norms = Interpreter(executor), params_of(executor, role), []
    for step in range(2):
        state, metrics = interpreter.run(program, prompts(count, offset=step * count), more_prompts=prompt_source(count))
        assert state[role] == ModelRef(role, step + 1)
        assert math.isfinite(metrics[f"{role}/loss"]) and math.isfinite(metrics[f"{role}/grad_norm"]), metrics
        grad_norms.append(metrics[f"{role}/grad_norm"])
    assert max(grad_norms) > 0  # a real gradient, not only AdamW's weight decay
    assert any(not torch.equal(a, b) for a, b in zip(before, params_of(executor, role)))
    return str(program), metrics
