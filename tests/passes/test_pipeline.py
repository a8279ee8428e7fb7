"""The compiler end to end: properties every plan must have, golden text, compiled == eager."""

import pytest
from hypothesis import given, settings, strategies as st

import rlgraph as rg
import rlgraph.testing as rgt
from rlgraph.algorithms import grpo
from rlgraph.ir import specs as S
from rlgraph.passes.place import PlacementConfigError
from rlgraph.plan import memory as M
from rlgraph.plan.plan import Plan
from tests.helpers import prompts

SIZES = {"B": 64, "P": 512, "T": 1024}

placements = st.sampled_from([
    ("gpu:8", rg.colocated()), ("gpu:8", rg.colocated(tp=2)), ("gpu:8", rg.colocated(fsdp=4, tp=4, offload=False)),
    ("gpu:8", rg.split({"policy": 4, "rollout": 4, "ref": "policy"})),
    ("2x8:h100", rg.split({"policy": 8, "rollout": 8, "ref": "policy"}, tp=2)),
    ("2x8:h100", rg.colocated(tp=4)),
])


def compile_grpo(mesh, placement, kl=0.001, micro=4, model="llama3-8b"):
    return rg.compile(grpo, mesh=mesh, placement=placement, sizes=dict(SIZES, n=8), models={"policy": model},
                      n=8, kl=kl, micro_batch_size=micro)


@settings(max_examples=12, deadline=None)
@given(placements, st.sampled_from([0.0, 0.001]))
def test_grpo_plans_have_the_invariants_on_the_catalogued_placements(case, kl):
    """One collective per cross-layout edge, bytes equal to the values moved, stages in dependency
    order, every node run once: `rlgraph.testing.assert_plan_invariants` (random algorithms and
    placements: tests/testing/test_plans.py)."""
    compiled = compile_grpo(*case, kl=kl)
    rgt.assert_plan_invariants(compiled)
    rollouts = sum(spec.nbytes(compiled.options.concrete(8)) for _, spec in S.ROLLOUTS.fields)
    assert any(t.bytes == rollouts for t in compiled.plan.transfers())


@settings(max_examples=8, deadline=None)
@given(placements)
def test_json_round_trip_is_the_identity(case):
    plan = compile_grpo(*case).plan
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.as_text() == plan.as_text()


def test_plan_shows_roles_collectives_and_memory():
    text = compile_grpo("gpu:8", rg.split({"policy": 4, "rollout": 4, "ref": "policy"})).as_text()
    assert "rollout   ranks 4-7    generate: vllm tp=1 dp=4" in text
    assert "policy    ranks 0-3    train: fsdp2 shard=4 ckpt" in text
    assert "sync_weights policy@v  policy[fsdp2 shard=4 ckpt] -> rollout[vllm tp=1 dp=4]" in text
    assert "send_recv  generate:Rollouts[N,T]  rollout -> ref  8.75 MiB" in text
    assert "32 micro-batch(es) of 4 rows/rank" in text


def test_diff_of_two_plans_names_what_changed():
    a = compile_grpo("gpu:8", rg.colocated()).plan
    b = compile_grpo("gpu:8", rg.colocated(tp=2)).plan
    diff = a.diff(b)
    assert "-" in diff and "+  policy    ranks 0-7    train: fsdp2 shard=8 ckpt; generate: vllm tp=2 dp=4" in diff



def test_split_beyond_the_mesh_is_refused():
    with pytest.raises(PlacementConfigError, match="ranks 0-7"):
        compile_grpo("gpu:8", rg.split({"policy": 8, "rollout": 8, "ref": "policy"}))


def test_70b_adamw_on_one_node_does_not_fit():
    with pytest.raises(M.PlacementError) as exc:
        compile_grpo("gpu:8", rg.colocated(tp=8), model="llama3-70b", micro=1)
    text = str(exc.value)
    assert "role policy" in text and "rank 0" in text and "GiB" in text and "80.0 GiB" in text and "fix:" in text


def test_to_dot_has_a_cluster_per_group():
    dot = compile_grpo("gpu:8", rg.split({"policy": 4, "rollout": 4, "ref": "policy"})).to_dot()
    assert dot.startswith("digraph plan") and "cluster_rollout" in dot and "cluster_policy" in dot and "sync_weights" in dot


@pytest.mark.parametrize("micro", [None, 4])
def test_compiled_fused_plan_gives_the_same_numbers_as_eager(micro):
    """The demo's first steps: the plan runner (fused kernels, torch references on CPU) against the
    eager interpreter (plain ops). Float rounding only: metrics rel 1e-5, parameters atol 1e-6 under
    SGD. With micro-batches the kernels must receive the mini-batch's global counts to agree."""
    compiled = rg.compile(grpo, mesh="cpu:1", placement=rg.colocated(offload=False, checkpointing=False),
                          sizes={"B": 4, "P": 8, "T": 4}, n=4, max_new_tokens=4, micro_batch_size=micro)
    assert "fused_ppo_clip (in loss)" in compiled.as_text() and "fused_group_normalize" in compiled.as_text()
    rgt.assert_compiled_matches_eager(grpo, executor=rgt.tiny_executor, batches=[prompts(4, offset=4 * i) for i in range(2)],
                                      sizes={"B": 4, "P": 8, "T": 4}, n=4, max_new_tokens=4, micro_batch_size=micro)


def test_golden_grpo_plan():
    """Pins the printed GRPO plan (split 4+4, Llama-3-8B); regenerate deliberately when the plan changes."""
    from pathlib import Path

    golden = (Path(__file__).parent / "golden_grpo_split.txt").read_text()
    assert compile_grpo("gpu:8", rg.split({"policy": 4, "rollout": 4, "ref": "policy"})).as_text() + "\n" == golden
    assert golden in (Path(__file__).parents[2] / "docs" / "plans.md").read_text()  # docs/plans.md shows this plan


@rg.traceable
def _sum_over_batch(values, mask):
    """A user's aggregation the fused loss does not implement: the masked sum over the batch."""
    return (values * mask).sum()


@rg.algorithm
def _grpo_custom_agg(state: rg.State, prompts: rg.Prompts, *, n=4):
    ro = rg.generate(state.policy, prompts, n=n)
    r = rg.score(state.reward, ro)
    adv = rg.functional.group_normalize(r, ro.group)

    def loss(lp):
        value, _, _ = rg.functional.ppo_clip(lp, ro.logprobs, adv[:, None], ro.mask, agg=_sum_over_batch)
        return value

    return state.replace(policy=rg.update(state.policy, ro, loss)), {"reward": r.mean()}


def test_a_loss_with_an_aggregation_the_kernel_lacks_runs_unfused_and_the_plan_says_why():
    """The fused PPO kernel implements four aggregations; any other one used to reach the kernel and raise.
    Now the call runs as traced (same numbers as eager, tolerances as above) and the plan names the reason."""
    compiled = rg.compile(_grpo_custom_agg, mesh="cpu:1", placement=rg.colocated(offload=False, checkpointing=False),
                          sizes={"B": 4, "P": 8, "T": 4}, n=4)
    text = compiled.as_text()
    assert "fused_ppo_clip" not in text
    assert "ppo_clip not fused: aggregation '_sum_over_batch' is not one the kernel implements (in loss)" in text
    rgt.assert_compiled_matches_eager(_grpo_custom_agg, executor=rgt.tiny_executor,
                                      batches=[prompts(4, offset=4 * i) for i in range(2)], sizes={"B": 4, "P": 8, "T": 4}, n=4)


def test_a_plain_function_passed_to_a_traced_op_is_a_trace_error_naming_the_line():
    def plain_sum(values, mask):
        return (values * mask).sum()

    @rg.algorithm
    def algo(state: rg.State, prompts: rg.Prompts):
        ro = rg.generate(state.policy, prompts, n=2)
        adv = rg.functional.group_normalize(rg.score(state.reward, ro), ro.group)
        policy = rg.update(state.policy, ro,
                           lambda lp: rg.functional.ppo_clip(lp, ro.logprobs, adv[:, None], ro.mask, agg=plain_sum)[0])
        return state.replace(policy=policy), {}

    with pytest.raises(rg.TraceError, match=r"plain Python function '.*plain_sum' cannot be passed") as info:
        rg.compile(algo, mesh="cpu:1", sizes={"B": 2, "P": 8, "T": 4})
    assert "test_pipeline.py" in str(info.value) and "@rg.traceable" in str(info.value)
