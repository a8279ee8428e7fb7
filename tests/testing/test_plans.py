"""Plan invariants over random algorithms and placements, reshard round trips, compiled == eager."""

import attrs
import pytest
import torch
from hypothesis import given, settings, strategies as st

import rlgraph as rg
import rlgraph.testing as rgt
from rlgraph.algorithms import grpo
from rlgraph.errors import ConfigError
from rlgraph.passes.reshard import transfer
from rlgraph.runtime import collectives as C

SIZES = {"B": 8, "P": 16, "T": 16}


@settings(max_examples=30)
@given(rgt.algorithms(), rgt.meshes(), st.data())
def test_every_random_algorithm_compiles_to_a_plan_with_the_invariants(generated, mesh, data):
    placement = data.draw(rgt.placements(mesh, generated.model_roles), label="placement")
    compiled = rg.compile(generated.algorithm, mesh=mesh, placement=placement, roles=generated.roles, sizes=SIZES,
                          **generated.hparams)
    rgt.assert_plan_invariants(compiled)


def test_a_plan_missing_a_collective_is_caught():
    compiled = rg.compile(grpo, mesh="gpu:8", placement=rg.split({"policy": 4, "rollout": 4, "ref": "policy"}),
                          sizes=SIZES, n=4, kl=0.01)
    rgt.assert_plan_invariants(compiled)
    graph = compiled.program.graph
    node = next(n for n in graph.nodes if n.target is transfer)
    node.replace_all_uses_with(node.args[0])  # the consumer now reads the value where it is not
    graph.erase_node(node)
    with pytest.raises(rgt.PropertyFailure, match="without a collective|run by no step"):
        rgt.assert_plan_invariants(compiled)


def test_reshard_round_trips_between_any_two_layouts():
    rgt.assert_reshard_round_trip()


def test_reshard_round_trip_of_rollouts_across_groups():
    from rlgraph.testing.plans import stand_in
    from rlgraph.ir import specs as S

    rgt.assert_reshard_round_trip(((0, 1, 2, 3), 4), ((4, 5, 6, 7), 2), stand_in(S.ROLLOUTS, rows=9))


def test_collectives_scatter_gather_and_refuse_the_wrong_kind():
    value = torch.arange(10).reshape(5, 2)
    placed = C.shard(value, ("controller",))
    on_group, sent = C.move(placed, ("controller",), ((0, 1, 2, 3), 2), "scatter")
    assert torch.equal(on_group[0], value[:3]) and torch.equal(on_group[1], value[:3]) and torch.equal(on_group[2], value[3:])
    assert sent == value.numel() * value.element_size()
    with pytest.raises(C.CollectiveError, match="that is a all_to_all"):
        C.move(on_group, ((0, 1, 2, 3), 2), ((0, 1, 2, 3), 4), "send_recv")
    regrouped, sent = C.move(on_group, ((0, 1, 2, 3), 2), ((0, 1, 2, 3), 4), "all_to_all")
    assert torch.equal(C.unshard(regrouped, ((0, 1, 2, 3), 4)), value)
    assert sent < value.numel() * value.element_size()  # rows already on a rank stay there


@pytest.mark.slow
@settings(max_examples=6)
@given(rgt.algorithms())
def test_random_algorithms_run_the_same_compiled_and_eager(generated):
    rgt.assert_compiled_matches_eager(
        generated.algorithm, executor=lambda: rgt.tiny_executor(generated.model_roles), roles=generated.roles,
        batches=[rgt.tiny_prompts(2, offset=2 * i) for i in range(2)],
        more_prompts=[rgt.tiny_prompts(2, offset=10 + 2 * i) for i in range(2)], **generated.hparams)


def test_a_plan_whose_loop_misses_a_step_is_caught():
    from rlgraph.algorithms import dapo

    compiled = rg.compile(dapo, mesh="gpu:8", placement=rg.split({"policy": 4, "rollout": 4}), sizes=SIZES, n=4)
    rgt.assert_plan_invariants(compiled)
    loop = compiled.plan.loops[0]
    broken = attrs.evolve(compiled, plan=attrs.evolve(compiled.plan, loops=(attrs.evolve(loop, steps=loop.steps[1:]),)))
    with pytest.raises(rgt.PropertyFailure, match="loop re-runs steps"):
        rgt.assert_plan_invariants(broken)


def test_grpo_compiled_matches_eager_with_micro_batches():
    metrics = rgt.assert_compiled_matches_eager(
        grpo, executor=rgt.tiny_executor, batches=[rgt.tiny_prompts(4, offset=4 * i) for i in range(2)],
        n=4, max_new_tokens=4, micro_batch_size=4)
    assert len(metrics) == 2 and "policy/loss" in metrics[0]


# -- end to end: an algorithm's steps do not depend on micro_batch_size ------------------------------

from rlgraph.algorithms import ALGORITHMS  # noqa: E402
from rlgraph import functional as F  # noqa: E402

RL_ALGORITHMS = sorted(name for name in ALGORITHMS if name not in ("sft", "pretrain", "evaluate"))


@pytest.mark.slow
@pytest.mark.parametrize("name", RL_ALGORITHMS)
def test_every_library_algorithm_is_micro_batch_invariant_end_to_end(name):
    algorithm = ALGORITHMS[name]
    hparams = {"max_new_tokens": 3, "n": 2}
    if name == "dapo":  # the default overlong_buffer=4 would cover all 3 tokens: refused
        hparams["overlong_buffer"] = 1
    if name == "agent_grpo":  # multi-turn: two turns of the tiny executor's OnesEnv, observations between them
        hparams = {"max_total_tokens": 10, "max_tokens_per_turn": 3, "max_turns": 2, "n": 2}
    rgt.assert_update_microbatch_invariant(
        algorithm, executor=lambda: rgt.tiny_executor(("policy", "ref", "critic", "teacher")),
        batches=[rgt.tiny_prompts(2, offset=2 * i) for i in range(2)],
        more_prompts=[rgt.tiny_prompts(2, offset=20 + 2 * i) for i in range(8)], **hparams)


@rg.algorithm
def locally_normalized(state: rg.State, prompts: rg.Prompts, *, n=2, max_new_tokens=3, micro_batch_size=None):
    ro = rg.generate(state.policy, prompts, n=n, max_new_tokens=max_new_tokens)
    r = rg.score(state.reward, ro)
    adv = F.group_normalize(r, ro.group)[:, None]

    def loss(lp):  # broken on purpose: divides by the micro-batch's own token count
        mask = ro.mask.float()
        return (-(adv * lp) * mask).sum() / mask.sum().clamp(min=1.0)

    return state.replace(policy=rg.update(state.policy, ro, loss, micro_batch_size=micro_batch_size)), {}


def test_an_algorithm_whose_loss_normalizes_per_micro_batch_is_caught():
    # 3 prompts: with the seed-0 sampling stream the third group's rewards differ, so the loss is not 0
    with pytest.raises(rgt.PropertyFailure, match="update micro-batch invariance fails for locally_normalized") as exc:
        rgt.assert_update_microbatch_invariant(locally_normalized, executor=rgt.tiny_executor,
                                               batches=[rgt.tiny_prompts(3)], micro_batch_sizes=(1,))
    assert "micro_batch_size=1" in str(exc.value)
    # the snippet is the call that repeats it: the algorithm imported by name, the prompts as literals
    snippet = exc.value.counterexample.snippet()
    assert "from tests.testing.test_plans import locally_normalized as algorithm" in snippet
    assert "executor = None" not in snippet and "micro_batch_sizes=[1]" in snippet
    with pytest.raises(rgt.PropertyFailure) as again:
        exec(snippet, {})
    assert str(again.value).splitlines()[0] == str(exc.value).splitlines()[0]  # the same numbers


def test_a_run_whose_updates_move_nothing_is_refused_not_passed():
    """2 prompts of the untrained tiny model: every group's length-parity rewards tie, so every advantage
    is 0, no parameter moves, and any micro-batch split would agree."""
    with pytest.raises(ConfigError, match=r"assert_update_microbatch_invariant\(grpo\): 1 step\(s\) without micro-batching "
                                          r"left every parameter of policy unchanged(.|\n)*fix: pass batches whose"):
        rgt.assert_update_microbatch_invariant(ALGORITHMS["grpo"], executor=lambda: rgt.tiny_executor(("policy",)),
                                               batches=[rgt.tiny_prompts(2)], micro_batch_sizes=(1,), n=2, max_new_tokens=3)
