"""Multi-turn GRPO (`agent_grpo`, `rg.rollout`) on two spmd ranks and two Ray actors against the local runtime."""

import pytest

import rlgraph as rg
from rlgraph.algorithms import agent_grpo
from rlgraph.backends.world import RoleSpec, WorldSpec
from rlgraph.runtime.plan_runner import PlanRunner
from rlgraph.runtime.spmd import SpmdTransport
from rlgraph.testing.tiny import OnesEnv, length_parity_reward, tiny_prompts
from tests.helpers import assert_same_metrics, assert_same_training, state_of

pytestmark = pytest.mark.slow

HPARAMS = dict(n=2, max_turns=2, max_tokens_per_turn=3, max_total_tokens=12)


def test_agent_grpo_on_two_spmd_ranks_matches_local():
    assert_matches_local(SpmdTransport)


def test_agent_grpo_on_two_spmd_ranks_with_env_workers_matches_local():
    """Each rank steps its rows' environments in its own env worker process; the local run steps them
    in the controller: the same metrics and weights."""
    assert_matches_local(SpmdTransport, env_workers=1)


def test_agent_grpo_on_two_ray_actors_matches_local():
    ray = pytest.importorskip("ray", reason="the ray runtime is the optional extra rlgraph[ray]")
    from rlgraph.runtime.ray_transport import RayTransport

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        assert_matches_local(RayTransport)
    finally:
        ray.shutdown()


def assert_matches_local(transport_type, **options):
    """Each rank generates its half of the prompts, steps its own environments between turns and
    trains its FSDP2 shard; metrics each step and the weights after equal one process's (the
    bounds of tests/helpers.py: other summation orders only). `options` of `rg.compile` apply to
    the distributed run only (where its environments step)."""
    world = WorldSpec({"policy": RoleSpec(optimizer="sgd", lr=0.1)}, {"reward": length_parity_reward},
                      max_new_tokens=12, envs={"env": OnesEnv})
    compiled, distributed = (rg.compile(agent_grpo, mesh="cpu:2", placement=rg.colocated(offload=False, checkpointing=False),
                                        sizes={"B": 4, "P": 8, "T": 12}, **HPARAMS, **extra) for extra in ({}, options))
    local_executor, prompts = world.build_local(), tiny_prompts(4)
    before = state_of(local_executor.models["policy"])
    with transport_type(distributed.plan, world, device="cpu") as transport:
        for step in range(2):
            local = PlanRunner(compiled, local_executor).run(prompts)[1]
            spmd = PlanRunner(distributed, transport, controller=world.controller()).run(prompts)[1]
            assert_same_metrics(local, spmd)
        assert local["policy/grad_norm"] > 0 and local["env/observation_tokens"] > 0
        assert_same_training(local_executor.models["policy"], transport.pull_state("policy"), before, steps=2)
