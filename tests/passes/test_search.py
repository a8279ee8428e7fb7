"""`placement="auto"`: the search over placements, ranked by the cost model, pruned by memory."""

import time

import pytest
from hypothesis import given, settings, strategies as st

import rlgraph as rg
import rlgraph.testing as rgt
from rlgraph.algorithms import ALGORITHMS, grpo
from rlgraph.passes.memory_plan import plan_memory
from rlgraph.passes.options import PlacementConfigError
from rlgraph.plan.memory import PERSISTENT, PlacementError
from rlgraph.plan.mesh import Colocated

SIZES = {"B": 64, "P": 512, "T": 1024}
# The hand-written placements of docs/plans.md and tests/passes/test_pipeline.py for this job.
HAND_WRITTEN = [rg.split({"policy": 4, "rollout": 4, "ref": "policy"}), rg.colocated(), rg.colocated(tp=2),
                rg.colocated(fsdp=4, tp=4, offload=False)]


def compile_grpo(placement, mesh="gpu:8"):
    return rg.compile(grpo, mesh=mesh, placement=placement, sizes=dict(SIZES, n=8), models={"policy": "llama3-8b"},
                      n=8, kl=0.001, micro_batch_size=4)


def test_auto_is_no_slower_than_any_hand_written_placement_of_the_docs():
    auto = compile_grpo("auto")
    assert auto.search is not None and auto.search.best.compiled is not None
    rgt.assert_plan_invariants(auto)  # the winner is an ordinary compiled plan
    for placement in HAND_WRITTEN:
        assert auto.cost_analysis().total <= compile_grpo(placement).cost_analysis().total


def test_the_report_ranks_the_top_k_and_says_why():
    text = compile_grpo("auto").as_text()
    assert "placement search:" in text and "  #1 " in text and "  #3 " in text
    assert "dominates its step" in text and "The runner-up" in text and "slower: it loses on" in text


def test_the_search_is_deterministic():
    a, b = compile_grpo("auto").search, compile_grpo("auto").search
    assert [c.text for c in a.ranked] == [c.text for c in b.ranked]
    assert [c.cost.total for c in a.ranked] == [c.cost.total for c in b.ranked]


def test_ppo_on_2x8_h100_7b_searches_fast():
    """Issue 14 asks for < 2 s; timings on the shared 2-core machine are in docs/benchmarks.md."""
    start = time.perf_counter()
    compiled = rg.compile(ALGORITHMS["ppo"], mesh="2x8:h100", placement="auto", sizes=dict(SIZES, n=1),
                          models={"policy": "qwen2.5-7b"})
    assert time.perf_counter() - start < 10 and compiled.search.seconds < 10
    assert len(compiled.search.ranked) > 10 and compiled.search.dropped > 0


meshes = st.sampled_from(["cpu:1", "cpu:2", "gpu:1", "gpu:2", "gpu:4", "1x8:a100", "2x2:h100", "2x4:l40s", "h20:4"])
models = st.sampled_from(["tiny-qwen2", "qwen2.5-0.5b", "qwen2.5-7b", "llama3-8b"])


@settings(max_examples=8, deadline=None)
@given(st.sampled_from(["grpo", "ppo"]), meshes, models, st.sampled_from([8, 16, 64]), st.sampled_from([64, 256]),
       st.sampled_from([64, 512]))
def test_every_returned_placement_fits_in_memory(name, mesh, model, batch, prompt, response):
    n = 4 if name == "grpo" else 1
    try:
        compiled = rg.compile(ALGORITHMS[name], mesh=mesh, placement="auto", models={"policy": model},
                              sizes={"B": batch, "P": prompt, "T": response, "n": n}, **({"n": n} if name == "grpo" else {}))
    except PlacementError as exc:
        assert "no placement fits" in str(exc) and "short by" in str(exc)
        return
    capacity = compiled.options.mesh.capacity_bytes
    for candidate in compiled.search.ranked:
        plan = candidate.compiled.plan
        assert all(plan.peak_memory(group.name) <= capacity for group in plan.groups if group.name in plan.memory)
        plan_memory(candidate.compiled.program, plan.groups, candidate.compiled.options)  # raises if it does not fit


def test_a_misspelt_placement_suggests_auto():
    with pytest.raises(PlacementConfigError, match="did you mean 'auto'"):
        compile_grpo("atuo")


def test_a_mesh_where_nothing_fits_names_the_closest_candidate_and_its_shortfall():
    with pytest.raises(PlacementError, match=r"no placement fits on the mesh 1x1 l40s .*the closest, colocated\(.*short by"):
        rg.compile(grpo, mesh="1x1:l40s", placement="auto", sizes=dict(SIZES, n=8), models={"policy": "llama3-70b"}, n=8)


@pytest.mark.parametrize("micro", [1, 4])
def test_the_refusal_suggests_a_smaller_micro_batch_only_when_there_is_one(micro):
    with pytest.raises(PlacementError) as refused:
        rg.compile(grpo, mesh="1x1:l40s", placement="auto", sizes=dict(SIZES, n=8), models={"policy": "llama3-70b"}, n=8,
                   micro_batch_size=micro)
    text = str(refused.value)
    if micro == 1:  # one row is the smallest micro-batch: the fixes say so instead of asking for a smaller one
        assert "micro_batch_size=...)" not in text and "smaller sizes (B, P, T)" in text
        assert "micro-batches are already 1 row (micro_batch_size=1)" in text
    else:
        assert "use a smaller micro-batch (micro_batch_size=...)" in text and "(B, P, T, micro_batch_size)" in text


def test_a_tie_is_called_a_tie():
    """SFT has no generation: FSDP over 4 or 8 ranks of a node trains at the same estimated speed."""
    compiled = rg.compile(ALGORITHMS["sft"], mesh="2x8:h100", placement="auto", sizes=dict(SIZES, n=1),
                          models={"policy": "qwen2.5-7b"})
    assert all(c.placement.tp == 1 for c in compiled.search.ranked)  # no generation: tp is not searched
    assert "a tie, broken by the placements' text" in compiled.search.text()


def _ppo_70b(mesh: str, placement="auto"):
    return rg.compile(ALGORITHMS["ppo"], mesh=mesh, placement=placement, models={"policy": "llama3-70b"},
                      sizes={"B": 32, "P": 64, "T": 256, "n": 1})


@pytest.mark.parametrize("nodes", [2, 3, 4, 5])
def test_ppo_70b_on_h100_nodes_gets_a_placement_that_fits_with_the_critic_counted_or_a_refusal_naming_it(nodes):
    """The search used to pick colocated(fsdp=24, tp=8, offload=True) on 3x8 at 54.98 GiB/rank: the
    largest phase alone, without the critic's 43.81 GiB of state that stays on the device meanwhile."""
    try:
        compiled = _ppo_70b(f"{nodes}x8:h100")
    except PlacementError as refused:
        assert nodes < 5, str(refused)
        text = str(refused)
        assert f"no placement fits on the mesh {nodes}x8 h100" in text and "role critic+policy does not fit on rank 0" in text
        assert "when: " in text and "critic.train" in text and "fix: " in text and "short by" in text
        return
    assert nodes == 5
    capacity = compiled.options.mesh.capacity_bytes
    for candidate in compiled.search.ranked:
        plan = candidate.compiled.plan
        plan_memory(candidate.compiled.program, plan.groups, candidate.compiled.options)  # the full model accepts it
        memory = plan.memory
        if isinstance(candidate.placement, Colocated):  # independently: a trainer's step beside the other's state
            resident = {role: sum(memory[role]["train"][part] for part in PERSISTENT) for role in ("policy", "critic")}
            assert memory["policy"]["train"]["total"] + resident["critic"] <= capacity
            assert memory["critic"]["train"]["total"] + resident["policy"] <= capacity


def test_the_old_3x8_choice_is_refused_by_the_memory_model_with_the_moment_that_overflows():
    with pytest.raises(PlacementError) as refused:
        _ppo_70b("3x8:h100", rg.colocated(fsdp=24, tp=8, offload=True))
    # The sync after an update: both trainers' state (2 x 43.81 GiB) and the woken engine's weights (16.43 GiB).
    assert "it needs 104.04 GiB but the device has 80.0 GiB" in str(refused.value)
    assert "when: policy.sync_weights runs; critic.infer, critic.train, policy.generate, policy.train keep" in str(refused.value)
    with pytest.raises(PlacementError, match=r"the closest, colocated\(fsdp=24, tp=8, offload=True\), is short by 24.04 GiB"):
        _ppo_70b("3x8:h100")
