"""`staleness=k`: the option's checks, the `overlap` pass's lanes, and what the plan prints."""

import inspect

import pytest
from hypothesis import given, settings, strategies as st

import rlgraph as rg
import rlgraph.testing as rgt
from rlgraph import functional as F
from rlgraph.algorithms import ALGORITHMS, grpo
from rlgraph.errors import ConfigError
from rlgraph.passes.options import CompileOptions, PlacementConfigError
from rlgraph.plan.memory import PlacementError
from rlgraph.plan.mesh import Mesh
from rlgraph.plan.plan import Plan

SPLIT = rg.split({"policy": 1, "rollout": 1})
TINY = {"B": 4, "P": 8, "T": 4}


def compile_tiny(name="grpo", placement=SPLIT, **options):
    return rg.compile(ALGORITHMS[name], mesh="cpu:2", placement=placement, sizes=dict(TINY), n=4, **options)


@pytest.mark.parametrize("value", [-1, 1.5, True, "1", None])
def test_a_staleness_that_is_not_a_whole_number_at_least_0_is_refused_naming_it(value):
    with pytest.raises(ConfigError, match=rf"staleness={value!r} is not a whole number >= 0"):
        compile_tiny(staleness=value)


@pytest.mark.parametrize("policy, expected", [("drop", "'drop' is not supported: the plan runner paces generation"),
                                              ("wiat", "'wiat' is not a staleness policy; did you mean 'wait'"),
                                              (1, "1 is not a staleness policy")])
def test_a_staleness_policy_other_than_wait_is_refused_with_the_reason(policy, expected):
    with pytest.raises(ConfigError, match=expected):
        compile_tiny(staleness=1, staleness_policy=policy)


def test_staleness_on_an_algorithm_that_generates_nothing_is_refused():
    with pytest.raises(ConfigError, match="staleness=1: algorithm 'sft' generates nothing") as error:
        rg.compile(ALGORITHMS["sft"], sizes=dict(TINY, n=1), staleness=1)
    assert "fix: staleness=0" in str(error.value)


def test_multi_turn_episodes_run_whole_in_the_rollout_lane_after_the_one_weight_sync():
    # issue 32: refused before; an episode's env steps are inside its rollout, which runs on one synced version
    compiled = rg.compile(ALGORITHMS["agent_grpo"], mesh="cpu:2", placement=rg.split({"policy": 1, "rollout": 1}),
                          sizes={"B": 4, "P": 8, "T": 16}, n=2, staleness=1)
    lanes = {node.name: node.meta["lane"] for node in compiled.program.graph.nodes if "lane" in node.meta}
    (rollout,) = compiled.program.primitive_nodes("rollout")
    assert lanes[rollout.name] == "rollout" and lanes["sync_policy"] == "rollout"
    assert [node for node in compiled.program.primitive_nodes("update") if lanes[node.name] == "train"]
    assert "async: staleness 1" in compiled.as_text()


def test_a_ratio_free_loss_is_refused_off_policy_unless_truncated_importance_weights_correct_it():
    with pytest.raises(ConfigError, match="uses gpg_loss, a policy gradient with no ratio to the policy that sampled"):
        compile_tiny(staleness=1, loss="gpg_loss")
    assert compile_tiny(staleness=1, loss="gpg_loss", tis_cap=2.0).plan.overlap is not None
    assert compile_tiny(loss="gpg_loss").plan.overlap is None  # synchronous: on-policy, fine


@rg.algorithm
def blind_pg(state: rg.State, prompts: rg.Prompts, *, n=4):
    ro = rg.generate(state.policy, prompts, n=n)              # Rollouts[N, T]
    adv = F.group_normalize(rg.score(state.reward, ro), ro.group)[:, None]  # [N, 1]

    def loss(lp):                                             # never looks at ro.logprobs
        return F.token_mean(-lp * adv, ro.mask), {}

    return state.replace(policy=rg.update(state.policy, ro, loss)), {}


def test_a_user_loss_that_reads_no_behaviour_logprobs_is_refused_off_policy():
    with pytest.raises(ConfigError, match="reads no log-probs of the sampled tokens") as error:
        rg.compile(blind_pg, mesh="cpu:2", placement=SPLIT, sizes=dict(TINY, n=4), staleness=1)
    assert "ratio = exp(lp - ro.logprobs)" in str(error.value)


def test_staleness_0_leaves_the_plan_as_it_was():
    assert compile_tiny(staleness=0).plan == compile_tiny().plan
    assert CompileOptions().staleness == 0


def test_a_split_plan_prints_both_lanes_the_bound_the_versions_and_the_overlapped_time():
    compiled = compile_tiny(staleness=1)
    overlap, steps = compiled.plan.overlap, compiled.plan.steps
    assert {steps[i].phase for i in overlap.train if hasattr(steps[i], "phase")} == {"train"}
    assert steps[overlap.rollout[0]].text().startswith("[0] sync_weights policy@v")  # the sync heads the rollout lane
    assert overlap.overlapped and overlap.rollout_groups == ("rollout",) and overlap.train_groups == ("policy",)
    assert overlap.note == ""  # nothing of the rollout lane runs on the trainer's rank
    # issued: the sync, the prompts' scatter and generation of batch i+1, then batch i's update, then the rest
    assert [steps[i].text().split()[1] for _, i in overlap.order[:4]] == ["sync_weights", "scatter", "generate", "train"]
    text = compiled.as_text()
    assert "async: staleness 1 (wait:" in text
    # each lane names only its own group's steps; the rest say where they run (the rewards and the
    # metrics on the controller, a read of the rollouts' fields on the trainer's rank)
    assert ("rollout lane (batch i+1) on rollout rank 1: steps 0-3, 5-8, 10; also on the controller: steps 4, 12; "
            "also on policy rank 0: steps 9\n") in text
    assert "train lane   (batch i)   on policy rank 0: steps 11" in text
    assert "batch i is generated by policy@max(0, i-1) and trained by policy@i (lag min(i, 1) <= 1)" in text
    cost = compiled.cost_analysis()
    lanes = cost.lane_seconds(overlap)
    assert cost.step_seconds == max(lanes.values()) < cost.total  # the lanes overlap: the slower one sets the pace
    assert abs(lanes["rollout"] + lanes["train"] - cost.total) <= 1e-12 * cost.total  # every step in one lane
    assert Plan.from_json(compiled.plan.to_json()) == compiled.plan


def test_a_reference_on_the_trainers_rank_overlaps_generation_and_is_counted_on_that_rank():
    compiled = compile_tiny(placement=rg.split({"policy": 1, "rollout": 1, "ref": "policy"}), kl=0.01, staleness=1)
    overlap, cost = compiled.plan.overlap, compiled.cost_analysis()
    assert overlap.overlapped and "ref" in overlap.rollout_groups
    assert "the rollout lane also works on rank(s) 0 of the train lane (ref): there it waits for the update" in overlap.note
    # rank 0 does the reference's forward and the update one after the other: the step is at least that long
    assert cost.step_seconds == max(*cost.lane_seconds(overlap).values(), cost.busiest_rank) < cost.total
    assert cost.busiest_rank > cost.lane_seconds(overlap)["train"]


def test_a_colocated_plan_says_there_is_nothing_to_overlap_and_recommends_a_split():
    compiled = compile_tiny(placement=rg.colocated(), staleness=2)
    assert not compiled.plan.overlap.overlapped
    assert compiled.cost_analysis().step_seconds == compiled.cost_analysis().total
    text = compiled.as_text()
    assert "nothing to overlap: generation runs on rank(s) 0, 1, where the train lane also works (policy)" in text
    assert "placement=split({'policy': 1, 'rollout': 1})" in text
    steps = compiled.plan.steps
    onload = next(step for step in steps if getattr(step, "direction", "") == "onload")
    assert onload.index in compiled.plan.overlap.train  # it makes room for the update, in the train lane


def test_a_refill_loop_stays_in_the_rollout_lane_and_only_its_filter_waits():
    compiled = compile_tiny("dapo", staleness=1, max_rounds=3)
    overlap, loop = compiled.plan.overlap, compiled.plan.loops[0]
    assert set(loop.steps) | {loop.filter_step} <= set(overlap.rollout)
    assert overlap.rollout[overlap.split] <= loop.filter_step  # the train lane is issued before the filter waits


def test_auto_placement_counts_the_overlap_and_picks_a_split_when_staleness_lets_the_lanes_overlap():
    sizes = {"B": 64, "P": 512, "T": 1024, "n": 8}

    def auto(staleness):
        return rg.compile(grpo, mesh="gpu:8", placement="auto", sizes=sizes, models={"policy": "llama3-8b"}, n=8,
                          kl=0.001, micro_batch_size=4, staleness=staleness)

    sync, overlapped = auto(0), auto(1)
    assert sync.plan.overlap is None and "colocated" in sync.plan.placement  # one lane: generation idles the trainer
    assert overlapped.plan.overlap.overlapped and overlapped.plan.placement.startswith("split")
    assert overlapped.cost_analysis().step_seconds < sync.cost_analysis().total
    ranked = [candidate.cost.step_seconds for candidate in overlapped.search.ranked]
    assert ranked == sorted(ranked)


# sft and evaluate generate nothing to overlap; agent_grpo's multi-turn episodes are refused (below)
OFF_POLICY = sorted(name for name in ALGORITHMS if name not in ("sft", "pretrain", "evaluate", "evaluate_agent", "agent_grpo"))


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_lanes_keep_their_invariants_for_any_algorithm_mesh_placement_and_bound(data):
    name = data.draw(st.sampled_from(OFF_POLICY))
    mesh = data.draw(st.sampled_from([Mesh.parse("cpu:2"), Mesh.parse("gpu:8")]))
    roles = ("policy", "ref", "critic") if name == "ppo" else ("policy", "ref")
    placement = data.draw(rgt.strategies.placements(mesh, roles))
    staleness, hparams = data.draw(st.integers(1, 3)), data.draw(st.sampled_from([{}, {"kl": 0.01}, {"tis_cap": 2.0}]))
    takes = inspect.signature(ALGORITHMS[name].fn).parameters
    hparams = {key: value for key, value in hparams.items() if key in takes}
    try:
        compiled = rg.compile(ALGORITHMS[name], mesh=mesh, placement=placement, sizes={"B": 8, "P": 8, "T": 4},
                              staleness=staleness, **hparams)
    except (PlacementConfigError, PlacementError):
        return  # a placement this mesh or engine cannot run: refused before the lanes
    rgt.assert_plan_invariants(compiled)
