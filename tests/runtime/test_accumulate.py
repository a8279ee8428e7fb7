"""Gradient accumulation as a dataflow: `rg.update(step=False)` adds gradients, `rg.optimizer_step`
applies them; `outputs=True` and an algorithm's third result hand per-token values back to the
caller, the same through the eager interpreter and the plan runner."""

import attrs
import pytest
import torch

import rlgraph as rg
from rlgraph import functional as F
from rlgraph.backends.local.training import NonFiniteUpdate
from rlgraph.errors import TraceError
from rlgraph.runtime.eager import Interpreter
from rlgraph.runtime.plan_runner import PlanRunner
from tests.helpers import make_executor, params_of, prompts


def _loss(ro):
    adv = rg.column(ro, "advantages")                                      # f32[N,T]
    return lambda lp: -F.masked_sum(adv * lp, ro.mask)


@rg.algorithm
def accumulate(state: rg.State, ro: rg.Rollouts):
    policy, lp = rg.update(state.policy, ro, _loss(ro), grad_clip=None, step=False, outputs=True)
    return state.replace(policy=policy), {}, {"lp": lp}


@rg.algorithm
def apply_gradients(state: rg.State, ro: rg.Rollouts, *, lr=0.1):
    return state.replace(policy=rg.optimizer_step(state.policy, lr=lr)), {}


@rg.algorithm
def one_update(state: rg.State, ro: rg.Rollouts):
    return state.replace(policy=rg.update(state.policy, ro, _loss(ro), grad_clip=None)), {}


def sgd_executor_and_rollouts():
    executor = make_executor()
    worker = executor.models["policy"]
    worker.optimizer = torch.optim.SGD(worker.model.parameters(), lr=0.1)  # the step is the gradient
    ro = executor.generate(executor.current("policy"), prompts(2), n=2, max_new_tokens=3)  # Rollouts[4, 3]
    advantages = torch.linspace(-1.0, 1.0, 12).reshape(4, 3)
    return executor, attrs.evolve(ro, meta={"advantages": list(advantages)})


def compiled(algo):
    return rg.compile(algo, mesh="cpu:1", placement=rg.colocated(offload=False), sizes={"B": 2, "n": 2, "P": 8, "T": 3})


def test_two_accumulated_halves_then_a_step_equal_one_update_of_the_whole_batch():
    whole, ro = sgd_executor_and_rollouts()
    Interpreter(whole).run(one_update.trace(), ro)
    split, _ = sgd_executor_and_rollouts()
    before = params_of(split)
    for half in (torch.tensor([0, 1]), torch.tensor([2, 3])):
        PlanRunner(compiled(accumulate), split).run(ro.select(half))
    assert all(torch.equal(a, b) for a, b in zip(before, params_of(split)))  # accumulating changed no weight
    _, metrics = PlanRunner(compiled(apply_gradients), split).run(None)
    assert metrics["policy/grad_norm"] > 0
    assert all(p.grad is None for p in split.models["policy"].model.parameters())  # applied, then cleared
    # The loss is a sum over rows, so the gradient of the batch is the sum of the halves' gradients;
    # the two runs differ only in the order fp32 adds the rows' terms: a few ulps (2^-23 ~ 1.2e-7
    # relative) of each gradient, times lr 0.1, on weights of magnitude <= ~1: 1e-6 absolute bounds it.
    for a, b in zip(params_of(whole), params_of(split)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_the_update_hands_back_its_training_log_probs_the_same_through_both_runners():
    eager_executor, ro = sgd_executor_and_rollouts()
    eager = Interpreter(eager_executor)
    eager.run(accumulate.trace(), ro)
    plan_executor, _ = sgd_executor_and_rollouts()
    runner = PlanRunner(compiled(accumulate), plan_executor)
    runner.run(ro)
    assert set(eager.outputs) == set(runner.outputs) == {"lp"}
    assert torch.equal(eager.outputs["lp"], runner.outputs["lp"])  # one program, two runners: the same ops
    reference = eager_executor.logprobs(eager_executor.current("policy"), ro)  # [4, 3], no-grad forward
    # The training forward and the no-grad forward run the same fp32 ops on the same weights.
    torch.testing.assert_close(runner.outputs["lp"], reference, rtol=0, atol=1e-6)
    assert "gradients accumulated, no optimizer step; per-token outputs returned" in compiled(accumulate).as_text()


def test_a_non_finite_gradient_never_reaches_the_weights():
    executor, ro = sgd_executor_and_rollouts()
    before = params_of(executor)
    poisoned = attrs.evolve(ro, meta={"advantages": [torch.full((3,), float("nan"))] * 4})
    with pytest.raises(NonFiniteUpdate, match=r"gradient norm is nan(.|\n)*rows with a non-finite loss here: \[0, 1, 2, 3\]"):
        PlanRunner(compiled(accumulate), executor).run(poisoned)  # the accumulating update keeps the guard
    for param in executor.models["policy"].model.parameters():
        param.grad = torch.full_like(param, float("inf"))  # as a caller that did not restore them would leave them
    with pytest.raises(NonFiniteUpdate, match="the accumulated gradient norm is inf; the gradients were dropped"):
        PlanRunner(compiled(apply_gradients), executor).run(None)
    assert all(torch.equal(a, b) for a, b in zip(before, params_of(executor)))
    assert all(p.grad is None for p in executor.models["policy"].model.parameters())


@pytest.mark.parametrize("config, match", [
    (dict(step=False), r"step=False, grad_clip=1.0\): an accumulating update cannot clip(.|\n)*grad_clip=None here"),
    (dict(step=False, grad_clip=None, on_nonfinite="skip"), r"has no step to skip"),
    (dict(step="no"), r"step must be True or False"),
    (dict(outputs=1), r"outputs must be True or False"),
])
def test_update_refuses_accumulation_settings_that_would_change_the_later_step(config, match):
    @rg.algorithm
    def algo(state: rg.State, ro: rg.Rollouts):
        return state.replace(policy=rg.update(state.policy, ro, lambda lp: -lp.sum(), **config)), {}

    with pytest.raises(TraceError, match=match):
        algo.trace()


@pytest.mark.parametrize("config, match", [
    (dict(lr=-1.0), r"rg.optimizer_step: lr=-1.0 is not valid"),
    (dict(betas=(0.9,)), r"betas must be a pair of floats in \[0, 1\)"),
    (dict(grad_clip=0.0), r"rg.optimizer_step: grad_clip=0.0 is not valid"),
    (dict(eps=0), r"rg.optimizer_step: eps=0 is not valid"),
])
def test_optimizer_step_refuses_bad_settings(config, match):
    @rg.algorithm
    def algo(state: rg.State, ro: rg.Rollouts):
        return state.replace(policy=rg.optimizer_step(state.policy, **config)), {}

    with pytest.raises(TraceError, match=match):
        algo.trace()


@pytest.mark.parametrize("result, match", [
    (lambda state, ro: (state, {}, {"n": 3}), r"output 'n' of algo must be a traced tensor or record"),
    (lambda state, ro: (state, {}, {}, {}), r"must return \(state, metrics\) or \(state, metrics, outputs\)"),
    (lambda state, ro: (state, {}, [ro.mask]), r"must return \(state, metrics\) or \(state, metrics, outputs\)"),
])
def test_bad_outputs_are_refused(result, match):
    @rg.algorithm
    def algo(state: rg.State, ro: rg.Rollouts):
        return result(state, ro)

    with pytest.raises(TraceError, match=match):
        algo.trace()


def test_outputs_print_after_the_metrics():
    text = str(accumulate.trace())
    assert text.splitlines()[-1].strip() == "in (state{policy=c}, {policy=e}, {lp=d}) }"
