"""The same compiled plan on the `ray` transport (a local Ray cluster, 2 CPU actors) and on `local`."""

from __future__ import annotations

import pytest

pytest.importorskip("ray", reason="the ray runtime is the optional extra rlgraph[ray] (make test installs it)")

import ray  # noqa: E402

from rlgraph.runtime.ray_transport import RayTransport  # noqa: E402
from rlgraph.testing.tiny import tiny_prompts  # noqa: E402
from tests.runtime.test_spmd import (_assert_same_metrics, _assert_same_weights, _compile, _step_both, _world,  # noqa: E402
                                     failure_when_rank_1_dies_mid_step)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_grpo_on_two_ray_actors_matches_local():
    world, prompts = _world(), tiny_prompts(4)
    compiled = _compile("grpo", n=4)
    local_executor = world.build_local()
    with RayTransport(compiled.plan, world, device="cpu") as transport:
        assert len(transport.nodes) == 2
        for _ in range(2):
            local, remote = _step_both(compiled, local_executor, transport, world, prompts)
            _assert_same_metrics(local, remote)
        _assert_same_weights(local_executor.models["policy"].model, transport.pull_state("policy"))


def test_a_killed_actor_is_reported_with_the_step_the_rank_and_the_node():
    message = failure_when_rank_1_dies_mid_step(RayTransport, lambda t: ray.kill(t.actors[1]))
    assert "rank 1" in message and "died" in message and "on node" in message and "plan step [" in message
