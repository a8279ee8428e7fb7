"""The spmd runtime on one NCCL rank (a mesh of 1 GPU): FSDP2 with bf16 mixed precision against the
local CUDA executor (bf16 autocast), one GRPO step of the demo's plan.

UNTESTED: written against documented PyTorch APIs on a machine without a GPU; these tests skip
there. The two runs round differently (FSDP2 casts the weights to bf16; autocast casts each
matmul's inputs and keeps the residual stream in fp32), so the local run replays the rank's
rollouts and both are compared within bf16 tolerance (tests/gpu/_steps.py).
"""

import pytest
import torch

from rlgraph.runtime.plan_runner import PlanRunner
from rlgraph.runtime.spmd import SpmdTransport
from tests.gpu._steps import (
    CONFIG, PROMPTS, assert_close_metrics, assert_close_steps, demo_plan, replay, weights, world,
)

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_one_nccl_rank_with_fsdp2_bf16_matches_the_local_cuda_executor():
    compiled, spec = demo_plan("cuda"), world()
    with SpmdTransport(compiled.plan, spec, device="cuda") as transport:
        before = weights(transport.pull_state("policy"))
        spmd = PlanRunner(compiled, transport, controller=spec.controller()).run(PROMPTS)[1]
        rollouts = transport.fetch("generate", 0)  # what the rank's bf16 engine sampled, on the CPU
        pulled = transport.pull_state("policy")
    assert all(value.dtype == torch.float32 for value in pulled.values())  # FSDP2 keeps fp32 master weights
    trained = weights(pulled)
    local = spec.build_local("cuda")
    initial = local.models["policy"].model.state_dict()
    assert all(torch.equal(before[name], value.float().cpu()) for name, value in initial.items())  # the same start
    replay(local, rollouts)
    metrics = PlanRunner(compiled, local).run(PROMPTS)[1]
    assert metrics["reward"] == spmd["reward"] and metrics["policy/grad_norm"] > 0
    assert_close_metrics(spmd, metrics)
    assert_close_steps(before, trained, weights(local.models["policy"].model.state_dict()))
