"""The local executor on CUDA (bf16 autocast over fp32 weights) against the CPU fp32 reference:
one GRPO step of the demo's plan, the sampler, and where values live during a run.

UNTESTED: written against documented PyTorch APIs on a machine without a GPU; these tests skip
there. Tolerances and their reasons: tests/gpu/_steps.py.
"""

import math

import pytest
import torch

from rlgraph.backends.protocols import ModelRef
from rlgraph.runtime.plan_runner import PlanRunner
from tests.gpu._steps import (
    CONFIG, METRIC_TOLERANCE, PROMPTS, assert_close_metrics, assert_close_steps, demo_plan, record, replay, weights,
    world,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

POLICY = ModelRef("policy", 0)


def test_a_grpo_step_on_cuda_matches_the_cpu_fp32_step_on_the_same_rollouts():
    cpu, cuda = world().build_local("cpu"), world().build_local("cuda")
    before = weights(cpu.models["policy"].model.state_dict())
    sampled = record(cpu)
    want = PlanRunner(demo_plan("cpu"), cpu).run(PROMPTS)[1]
    replay(cuda, sampled[0])
    got = PlanRunner(demo_plan("cuda"), cuda).run(PROMPTS)[1]
    assert want["policy/grad_norm"] > 0 and got["reward"] == want["reward"]  # the same rollouts, the same rewards
    assert_close_metrics(got, want)
    trained = cuda.models["policy"].model
    assert_close_steps(before, weights(trained.state_dict()), weights(cpu.models["policy"].model.state_dict()))
    assert all(p.dtype == torch.float32 and p.is_cuda for p in trained.parameters())  # fp32 master weights


def test_cuda_sampling_draws_the_cpu_tokens_except_at_bf16_near_ties():
    cpu, cuda = world().build_local("cpu"), world().build_local("cuda")
    want = cpu.generate(POLICY, PROMPTS, n=CONFIG.rl_samples)
    got = cuda.generate(POLICY, PROMPTS, n=CONFIG.rl_samples)  # CPU prompts in, CPU rollouts out
    assert got.response_ids.device.type == "cpu" and got.logprobs.dtype == torch.float32
    same = (got.response_ids == want.response_ids).all(dim=1)  # [N]: rows whose every token agrees
    assert same.float().mean() >= 0.75, f"only {int(same.sum())} of {len(same)} rows agree"
    torch.testing.assert_close(got.logprobs[same], want.logprobs[same], atol=5e-2, rtol=0)
    recomputed = cuda.logprobs(POLICY, got)  # the trainer's recompute of the sampler's log-probs, both bf16
    assert recomputed.device.type == "cpu" and recomputed.dtype == torch.float32
    torch.testing.assert_close(recomputed, got.logprobs, atol=5e-2, rtol=0)


def test_a_local_cuda_run_keeps_worker_values_on_the_gpu_and_hands_the_controller_cpu_values():
    runner = PlanRunner(demo_plan("cuda"), world().build_local("cuda"))
    _, metrics = runner.run(PROMPTS)
    assert all(math.isfinite(value) for value in metrics.values())
    transport = runner.transport
    assert transport.worker.store["generate"].response_ids.is_cuda  # the worker's rollouts stay on the device
    assert transport.fetch("generate", 0).response_ids.device.type == "cpu"  # the controller's copy
    assert transport.worker.store["group_normalize"].is_cuda  # math on the worker ran there (a fused kernel)


def test_sft_and_evaluation_through_the_eager_interpreter_on_cuda_match_the_cpu():
    """The interpreter's values live on the CPU; the executor moves what it needs to the GPU and back."""
    from rlgraph.algorithms import evaluate, sft
    from rlgraph.data import arithmetic
    from rlgraph.runtime.eager import Interpreter
    from tests.helpers import SPLITS, TOKENIZER

    batch = arithmetic.to_demonstrations(SPLITS.train[:32], TOKENIZER)
    losses = {}
    for device in ("cpu", "cuda"):
        interpreter = Interpreter(world().build_local(device))
        losses[device] = [interpreter.run(sft.trace(), batch)[1]["policy/loss"] for _ in range(3)]
        accuracy = interpreter.run(evaluate.trace(max_new_tokens=CONFIG.max_new_tokens), PROMPTS)[1]["accuracy"]
        assert 0.0 <= accuracy <= 1.0
    for got, want in zip(losses["cuda"], losses["cpu"]):
        assert math.isclose(got, want, **METRIC_TOLERANCE), (losses["cuda"], losses["cpu"])
