"""The cost model: seconds per plan step, by phase, from the plan and a hardware profile."""

import attrs
import pytest

import rlgraph as rg
from rlgraph.algorithms import ALGORITHMS
from rlgraph.plan import cost as C
from rlgraph.plan.hardware import profile

SIZES = {"B": 64, "P": 512, "T": 1024, "n": 1}


def ppo(mesh="2x8:h100", placement=None, model="qwen2.5-7b"):
    return rg.compile(ALGORITHMS["ppo"], mesh=mesh, placement=placement or rg.colocated(), sizes=SIZES,
                      models={"policy": model})


def test_the_total_is_the_sum_of_steps_and_of_phases():
    cost = ppo().cost_analysis()
    assert len(cost.steps) == len(ppo().plan.steps)
    assert cost.total == pytest.approx(sum(cost.phases.values()))
    assert set(cost.phases) <= set(C.PHASES) and cost.dominant() == "generate"
    assert "estimated step time on h100" in ppo().as_text()


def test_decode_is_bound_by_reading_weights_and_kv_cache():
    compiled = ppo("h100:8", rg.colocated(offload=False))
    step = next(s for s in compiled.plan.stages() if s.phase == "generate")
    hw = profile("h100")
    memory = compiled.plan.memory["policy"]["generate"]
    reads = memory["params"] + memory["kv_cache"] * (512 + 512) / 1536
    expected = 1024 * reads / (hw.memory_bandwidth * hw.decode_efficiency)
    seconds = compiled.cost_analysis().steps[step.index].seconds
    assert expected < seconds < expected * 1.1  # + the compute-bound prefill


def test_tensor_parallel_generation_is_faster_per_step_but_not_linearly():
    t1 = ppo(placement=rg.colocated(tp=1)).cost_analysis().phases["generate"]
    t2 = ppo(placement=rg.colocated(tp=2)).cost_analysis().phases["generate"]
    assert t1 / 2 < t2 < t1


def test_collectives_cross_the_network_between_nodes_and_nvlink_within():
    hw = profile("h100")
    mesh = rg.Mesh.parse("2x8:h100")
    assert C.link(mesh, (0, 1), (2, 3), hw)[1] == "NVLink"
    assert C.link(mesh, (0, 1), (8, 9), hw)[1] == "network"
    ring = C.collective_seconds("all_reduce", 1e9, 8, 1e9, attrs.evolve(hw, latency_s=0.0, link_efficiency=1.0))
    assert ring == pytest.approx(2 * 7 / 8)


def test_a_split_sync_within_a_node_is_cheaper_than_across_nodes():
    within = ppo("1x16:h100", rg.split({"policy": 8, "rollout": 8, "critic": "policy"}))
    across = ppo("2x8:h100", rg.split({"policy": 8, "rollout": 8, "critic": "policy"}))
    assert within.cost_analysis().phases["sync_weights"] < across.cost_analysis().phases["sync_weights"]


def test_offload_costs_host_link_time_and_a_faster_profile_costs_less():
    on = ppo(placement=rg.colocated(offload=True)).cost_analysis()
    off = ppo(placement=rg.colocated(offload=False)).cost_analysis()
    assert on.phases["offload"] > 0 and "offload" not in off.phases
    plan = ppo().plan
    assert plan.cost_analysis(profile("h200")).total < plan.cost_analysis(profile("a100")).total


def test_activation_checkpointing_costs_a_recomputed_forward():
    """On one node the step is compute-bound (across two, FSDP's traffic hides the recompute)."""
    ckpt = ppo("h200:8", rg.colocated(offload=False)).cost_analysis().phases["train"]
    plain = ppo("h200:8", rg.colocated(offload=False, checkpointing=False)).cost_analysis().phases["train"]
    assert ckpt == pytest.approx(plain * 4 / 3)


def test_a_plan_read_back_from_json_costs_the_same():
    from rlgraph.plan.plan import Plan

    plan = ppo(placement=rg.split({"policy": 8, "rollout": 8, "critic": "policy"}, tp=2)).plan
    assert Plan.from_json(plan.to_json()).cost_analysis() == plan.cost_analysis()
