"""The same compiled plan on the `ray` transport (a local Ray cluster, 2 CPU actors) and on `local`."""

from __future__ import annotations

import pytest

pytest.importorskip("ray", reason="the ray runtime is the optional extra rlgraph[ray] (make test installs it)")

import ray  # noqa: E402

from rlgraph.plan.mesh import split  # noqa: E402
from rlgraph.runtime.ray_transport import RayTransport  # noqa: E402
from rlgraph.testing.tiny import tiny_prompts  # noqa: E402
from tests.helpers import assert_same_metrics, assert_same_training, state_of  # noqa: E402
from tests.runtime.test_spmd import _compile, _step_both, _world, failure_when_rank_1_dies_mid_step  # noqa: E402

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
    before = state_of(local_executor.models["policy"])
    with RayTransport(compiled.plan, world, device="cpu") as transport:
        assert len(transport.nodes) == 2
        for _ in range(2):
            local, remote = _step_both(compiled, local_executor, transport, world, prompts)
            assert_same_metrics(local, remote)
        assert_same_training(local_executor.models["policy"], transport.pull_state("policy"), before, steps=2)


def test_a_killed_actor_is_reported_with_the_step_the_rank_and_the_node():
    message = failure_when_rank_1_dies_mid_step(RayTransport, lambda t: ray.kill(t.actors[1]))
    assert "rank 1" in message and "died" in message and "on node" in message and "plan step [" in message


def test_staleness_1_on_two_ray_actors_with_a_split_placement_matches_local():
    from tests.runtime.test_async import async_matches_local

    assert [m["rollout/staleness"] for m in async_matches_local(RayTransport)] == [0.0, 1.0, 1.0]


def test_distill_with_the_teacher_on_its_own_ray_actor_matches_local(tmp_path):
    from tests.runtime.test_spmd_distill import _teacher_world

    world, prompts = _teacher_world(tmp_path), tiny_prompts(4)
    compiled = _compile("distill", placement=split({"policy": 1, "teacher": 1}), n=2)
    assert "teacher   rank 1       infer dp=1" in compiled.as_text()
    local_executor = world.build_local()
    before = state_of(local_executor.models["policy"])
    with RayTransport(compiled.plan, world, device="cpu") as transport:  # one step: the teacher's actor scores, the student's trains
        local, remote = _step_both(compiled, local_executor, transport, world, prompts)
        assert_same_metrics(local, remote)
        assert local["distill/reverse_kl"] > 0.1  # the teacher, far from the student, gave a real signal
        assert_same_training(local_executor.models["policy"], transport.pull_state("policy"), before, steps=1)
