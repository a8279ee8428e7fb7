"""What the GPU tests share: the demo's RL plan at a small size, a world to build it from, and
comparisons within bf16 tolerance.

bf16 keeps 8 significant bits (relative rounding 2^-9 ~ 2e-3 per operation); through the tiny
model's two layers and the log-softmax the log-probs move by up to a few 1e-2. Hence:
- metrics: rel 5e-2 or abs 2e-2 (the loss and approx_kl are differences of such log-probs);
- a training step, with SGD so that it is the (clipped) gradient itself:
  ||step_a - step_b|| <= 5e-2 ||step_b|| over all parameters.
Sampling is Gumbel-max over the logits: bf16 rounding can flip a token where two candidates are
nearly tied, so step comparisons replay one run's rollouts in the other (`replay`).
"""

from __future__ import annotations

import math
import tempfile
from typing import Any

import attrs
import torch

from rlgraph.backends.world import RoleSpec, WorldSpec
from rlgraph.batches import Rollouts, to_device
from rlgraph.testing.tiny import length_parity_reward, tiny_prompts
from rlgraph.train.demo import DemoConfig, demo_setup

CONFIG = DemoConfig(rl_prompts=8, rl_samples=4, max_new_tokens=5)
PROMPTS = tiny_prompts(CONFIG.rl_prompts)
METRIC_TOLERANCE = dict(rel_tol=5e-2, abs_tol=2e-2)
STEP_TOLERANCE = 5e-2


def demo_plan(device: str) -> Any:
    """The demo's RL plan as `rlgraph demo` prepares it (`demo_setup`), on one device of kind `device`."""
    with tempfile.TemporaryDirectory() as directory:
        return demo_setup(attrs.evolve(CONFIG, device=device), directory).rl


def world() -> WorldSpec:
    """The policy as a recipe (SGD: a step is the gradient), with a reward that varies on an untrained model."""
    return WorldSpec({"policy": RoleSpec(optimizer="sgd", lr=0.5)}, {"reward": length_parity_reward},
                     max_new_tokens=CONFIG.max_new_tokens, seed=CONFIG.seed)


def record(executor) -> list[Rollouts]:
    """Wrap `executor.generate` so each call's rollouts are kept (on the CPU) in the returned list."""
    calls: list[Rollouts] = []
    generate = executor.generate

    def recorded(*args, **kwargs):
        rollouts = generate(*args, **kwargs)
        calls.append(to_device(rollouts, "cpu"))
        return rollouts

    executor.generate = recorded
    return calls


def replay(executor, rollouts: Rollouts) -> None:
    """Make `executor.generate` return `rollouts` (on the prompts' device) instead of sampling."""
    def replayed(model, prompts, **kwargs):
        executor.sampling.advance()  # the call a real generate would have used
        return to_device(rollouts, prompts.ids.device)

    executor.generate = replayed


def weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: value.detach().float().cpu().clone() for name, value in state.items()}


def assert_close_metrics(got: dict[str, float], want: dict[str, float]) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert math.isclose(got[key], want[key], **METRIC_TOLERANCE), (key, got[key], want[key])


def assert_close_steps(before: dict[str, torch.Tensor], got: dict[str, torch.Tensor],
                       want: dict[str, torch.Tensor]) -> None:
    """The two runs moved the weights from `before` by the same step, within `STEP_TOLERANCE`."""
    assert got.keys() == want.keys() == before.keys()
    step_got = torch.cat([(got[name] - before[name]).reshape(-1) for name in before])  # [n_params]
    step_want = torch.cat([(want[name] - before[name]).reshape(-1) for name in before])  # [n_params]
    assert step_want.norm() > 0, "the reference step trained nothing"
    error = float((step_got - step_want).norm() / step_want.norm())
    assert error <= STEP_TOLERANCE, f"the steps differ by {error:.3f} of the reference step's norm"
