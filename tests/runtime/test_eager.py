import math

import pytest
import torch

import rlgraph as rg
from rlgraph.algorithms import grpo, sft
from rlgraph.backends.local.executor import StaleVersionError
from rlgraph.backends.protocols import ModelRef
from rlgraph.runtime.eager import Interpreter
from tests.helpers import demonstrations, make_executor, params_of, parity_reward, prompts


def test_one_grpo_step_changes_parameters_and_reports_metrics():
    executor = make_executor(with_ref=True, reward=parity_reward)
    before = params_of(executor)
    state, metrics = Interpreter(executor).run(grpo.trace(n=4, kl=0.05, max_new_tokens=4), prompts(4))
    assert state["policy"] == ModelRef("policy", 1)
    assert 0.0 <= metrics["reward"] <= 1.0
    assert math.isfinite(metrics["policy/loss"]) and metrics["policy/grad_norm"] > 0
    assert 0.0 <= metrics["policy/clip_frac"] <= 1.0
    assert any(not torch.equal(a, b) for a, b in zip(before, params_of(executor)))
    assert all(torch.equal(a, b) for a, b in zip(params_of(make_executor(with_ref=True), "ref"), params_of(executor, "ref")))


def test_sft_loss_decreases():
    executor = make_executor(lr=3e-3)
    interpreter, program, batch = Interpreter(executor), sft.trace(), demonstrations(32)
    losses = [interpreter.run(program, batch)[1]["policy/loss"] for _ in range(15)]
    assert losses[-1] < 0.7 * losses[0], losses


def test_micro_batching_gives_the_same_sft_step():
    """Global token normalisation: 4 micro-batches of 8 == one batch of 32 (same update)."""
    batch = demonstrations(32)
    results = []
    for micro in (None, 8):
        executor = make_executor()
        worker = executor.models["policy"]
        worker.optimizer = torch.optim.SGD(worker.model.parameters(), lr=0.5)  # SGD: the step is the gradient
        _, metrics = Interpreter(executor).run(sft.trace(micro_batch_size=micro), batch)
        results.append((metrics["policy/loss"], params_of(executor)))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-5)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_each_primitive_on_the_local_backend():
    @rg.algorithm
    def probe(state: rg.State, prompts: rg.Prompts):
        ro = rg.generate(state.policy, prompts, n=3, max_new_tokens=4)
        lp, entropy = rg.logprobs(state.policy, ro, entropy=True)
        r = rg.score(state.reward, ro)
        gap = ((lp - ro.logprobs).abs() * ro.mask).sum() / ro.mask.sum()
        return state, {"gap": gap, "entropy": (entropy * ro.mask).sum() / ro.mask.sum(), "r": r.mean(),
                       "rows": ro.mask.float().sum(-1).clamp(max=1).sum()}

    _, metrics = Interpreter(make_executor()).run(probe.trace(), prompts(5))
    assert metrics["gap"] < 1e-4       # recomputed log-probs match the sampler's
    assert metrics["entropy"] > 0
    assert metrics["rows"] == 15       # N = B * n rows, each with at least one token


def test_a_stale_model_version_is_refused():
    executor = make_executor()
    with pytest.raises(StaleVersionError):
        executor.generate(ModelRef("policy", 3), prompts(1), n=1)


def test_update_gets_its_batch_and_captured_values_on_the_executors_device(monkeypatch):
    """The loss closure runs where the executor trains; its inputs are moved there ("meta" stands
    in for a GPU: a second device whose tensors have shapes and no data)."""
    from rlgraph.runtime import eager

    seen: dict[str, list[torch.device]] = {}

    class TrainsOnMeta:
        device = torch.device("meta")

        def __init__(self, executor):
            self.executor = executor

        def __getattr__(self, name):  # every other primitive: the real executor, on the CPU
            return getattr(self.executor, name)

        def update(self, model, batch, loss_fn, config):
            seen["batch"] = [batch.mask.device, batch.logprobs.device]
            return ModelRef(model.role, model.version + 1), {}

    def recording_loss_fn(loss, batch, captured):
        seen["captured"] = [value.device for value in captured if isinstance(value, torch.Tensor)]
        return original(loss, batch, captured)

    original = eager.make_loss_fn
    monkeypatch.setattr(eager, "make_loss_fn", recording_loss_fn)
    Interpreter(TrainsOnMeta(make_executor(reward=parity_reward))).run(grpo.trace(n=2, max_new_tokens=4), prompts(2))
    assert seen["captured"] and {d.type for d in seen["captured"] + seen["batch"]} == {"meta"}
