"""vLLM on the spmd runtime on CPU: two gloo worker processes, the policy FSDP2-sharded over them and
one vLLM engine on each (`rlgraph.backends.fsdp.build._vllm_engine`), filled by the plan's
sync_weights step from the gathered shards. Compared with the local runtime on the session's
engine (tests/backends/conftest.py). Runs in `.venv-vllm` (`make test`)."""

import copy
import importlib.util
import math

import pytest
import torch

import rlgraph as rg
from rlgraph.algorithms import ALGORITHMS
from rlgraph.backends.local.state import LMWorker
from rlgraph.backends.local.executor import RewardWorker
from rlgraph.backends.world import RoleSpec, WorldSpec
from rlgraph.runtime.plan_runner import PlanRunner
from rlgraph.runtime.spmd import SpmdTransport
from rlgraph.testing import tiny_prompts
from rlgraph.testing.tiny import length_parity_reward
from tests.backends.conftest import sync
from tests.backends.test_vllm_multiturn import TURNS, Digits

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM is not installed here: `make test` runs this module in .venv-vllm"),
              pytest.mark.slow]

SIZES = {"B": 4, "P": 8, "T": 4}
COLOCATED = rg.colocated(offload=False, checkpointing=False)
# |vLLM - trainer| per token log-prob, fp32 on both sides: the bound derived in test_vllm_live.py
LOGPROB_BOUND = 3e-3


def _grpo(mesh, **options):
    return rg.compile(ALGORITHMS["grpo"], mesh=mesh, placement=COLOCATED, sizes=SIZES, n=2, max_new_tokens=SIZES["T"],
                      engine="vllm", tis_cap=2.0, **options)


def _evaluate(mesh):
    from rlgraph.algorithms.evaluate import evaluate

    return rg.compile(evaluate, mesh=mesh, placement=COLOCATED, sizes={**SIZES, "n": 1}, engine="vllm",
                      trained=("policy",), max_new_tokens=SIZES["T"])


def _compare_stale_steps(local_executor, transport, world):
    """Two staleness-1 calls on each runtime (fresh runners: both start from the live version)."""
    stale = {mesh: _grpo(mesh, staleness=1) for mesh in ("cpu:1", "cpu:2")}
    runs = {}
    for mesh, target, controller in (("cpu:1", local_executor, None), ("cpu:2", transport, world.controller())):
        runner, drawn = PlanRunner(stale[mesh], target, controller=controller), [8]

        def more():
            drawn[0] += 1
            return tiny_prompts(4, offset=4 * drawn[0])

        runs[mesh] = [runner.run(tiny_prompts(4, offset=32) if step == 0 else more(), more_prompts=more)[1]
                      for step in range(2)]
    for local, spmd in zip(runs["cpu:1"], runs["cpu:2"]):
        for key in ("reward", "response_length/mean", "rollout/staleness"):
            assert spmd[key] == local[key], key
        assert math.isclose(spmd["policy/loss"], local["policy/loss"], abs_tol=math.expm1(LOGPROB_BOUND))
    assert [metrics["rollout/staleness"] for metrics in runs["cpu:2"]] == [0.0, 1.0]
    assert {report["served"] for report in transport.weights_report("policy").values()} == {3}  # batch 2 in flight


def _compare_agent_steps(local_executor, transport, world):
    """One compiled multi-turn step (`agent_grpo`, two turns of `Digits`) on each runtime: each rank runs its
    rows' episodes on its own engine, token in and token out, with the row seeds of any shard."""
    from rlgraph.algorithms import agent_grpo

    runs = {}
    for mesh, target, controller in (("cpu:1", local_executor, None), ("cpu:2", transport, world.controller())):
        compiled = rg.compile(agent_grpo, mesh=mesh, placement=COLOCATED, engine="vllm", n=2,
                              sizes={"B": 2, "P": 8, "T": TURNS["max_total_tokens"]}, **TURNS)
        runs[mesh] = PlanRunner(compiled, target, controller=controller).run(tiny_prompts(2, offset=60))[1]
    local, spmd = runs["cpu:1"], runs["cpu:2"]
    for key in ("reward", "response_length/mean", "env/turns"):
        assert spmd[key] == local[key], key
    assert spmd["env/turns"] == pytest.approx(2.0)
    assert abs(spmd["policy/logprob_diff"]) < LOGPROB_BOUND  # the trainer's recompute of each rank's episodes
    assert math.isclose(spmd["policy/loss"], local["policy/loss"], abs_tol=math.expm1(LOGPROB_BOUND))


def test_grpo_evaluation_and_staleness_on_two_spmd_ranks_with_a_vllm_engine_each_match_local_vllm(vllm_live, tmp_path):
    """Two steps. Every row is sampled with the seed of (call, prompt, sample), whichever rank runs it, so
    both runtimes sample the same tokens and the token metrics agree exactly. The log-probs differ by
    rounding only (vLLM's batch of 4 rows against 8, FSDP2's summed shards): each per-token value
    within LOGPROB_BOUND, so a loss (a mean of ratio x advantage, |advantage| <= 1 with n=2) within
    e^bound - 1 of the other."""
    engine, model, tokenizer = vllm_live
    model.config.save_pretrained(tmp_path)  # the workers build their engines from this config, with dummy weights
    weights = {name: value.clone() for name, value in model.state_dict().items()}
    world = WorldSpec({"policy": RoleSpec(source=str(tmp_path), weights=weights, optimizer="sgd", lr=0.1)},
                      {"reward": length_parity_reward}, max_new_tokens=SIZES["T"], envs={"env": Digits})
    policy = copy.deepcopy(model).train()
    from rlgraph.backends.vllm.local import VLLMLocalExecutor

    local_executor = VLLMLocalExecutor({"policy": LMWorker(policy, torch.optim.SGD(policy.parameters(), lr=0.1))},
                                       {"reward": RewardWorker(length_parity_reward)}, tokenizer, engine=engine,
                                       max_new_tokens=SIZES["T"], envs={"env": Digits})
    local_plan, spmd_plan = _grpo("cpu:1"), _grpo("cpu:2")
    assert "policy[vllm tp=1 dp=2]" in spmd_plan.as_text()
    try:
        with SpmdTransport(spmd_plan.plan, world, device="cpu") as transport:
            runner = PlanRunner(spmd_plan, transport, controller=world.controller())
            for step in range(2):
                prompts = tiny_prompts(4, offset=4 * step)
                local = PlanRunner(local_plan, local_executor).run(prompts)[1]
                spmd = runner.run(prompts)[1]
                for key in ("reward", "response_length/mean", "response_length/max"):
                    assert spmd[key] == local[key], (step, key)
                assert spmd["logprob_mismatch/max"] < LOGPROB_BOUND  # the ranks' engines hold the trained weights
                assert math.isclose(spmd["policy/loss"], local["policy/loss"], abs_tol=math.expm1(LOGPROB_BOUND))
            served = {rank: report["served"] for rank, report in transport.weights_report("policy").items()}
            assert served == {0: 1, 1: 1}  # each rank's engine serves the version its last generate asked for
            # evaluation (greedy, as `rlgraph train` evaluates on the workers): its plan syncs policy@2 first
            held_out = tiny_prompts(4, offset=100)
            local = PlanRunner(_evaluate("cpu:1"), local_executor).run(held_out)[1]
            spmd = PlanRunner(_evaluate("cpu:2"), transport, controller=world.controller()).run(held_out)[1]
            assert [spmd[key] for key in ("accuracy", "response_tokens")] == [local["accuracy"], local["response_tokens"]]
            assert {report["served"] for report in transport.weights_report("policy").values()} == {2}
            # staleness 1 on the same workers, from the live policy@2: batch i generated by policy@max(2, 2+i-1)
            _compare_stale_steps(local_executor, transport, world)
            # multi-turn rg.rollout on the same workers: a rank's episodes on its engine, as local vLLM's
            _compare_agent_steps(local_executor, transport, world)
    finally:
        sync(engine, model, 0)  # the session's engine back at version 0
