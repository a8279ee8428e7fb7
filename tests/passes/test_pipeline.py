"""The compiler end to end: properties every plan must have, golden text, compiled == eager."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

import rlgraph as rg
from rlgraph.algorithms import grpo, sft
from rlgraph.ir import specs as S
from rlgraph.passes.partition import value_bytes
from rlgraph.passes.place import PlacementConfigError
from rlgraph.passes.reshard import layout_of, sync_weights, transfer
from rlgraph.plan import memory as M
from rlgraph.plan.plan import Plan, Stage, Transfer
from rlgraph.runtime.eager import Interpreter
from rlgraph.runtime.plan_runner import PlanRunner
from tests.helpers import make_executor, params_of, parity_reward, prompts

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
def test_every_cross_layout_edge_has_exactly_one_collective(case, kl):
    mesh, placement = case
    compiled = compile_grpo(mesh, placement, kl=kl)
    program = compiled.program
    groups = {group.name: group for group in program.annotations["groups"]}
    for node in program.graph.nodes:
        if node.op in ("placeholder", "output") or node.target in (transfer,):
            continue
        for arg in node.all_input_nodes:
            if isinstance(arg.meta["spec"], (S.ModelSpec, S.RewardSpec, S.StatsSpec)):
                continue
            if arg.target is transfer:
                source = arg.args[0]
                assert layout_of(source, groups) != layout_of(node, groups, source), f"useless transfer {arg.name}"
                assert source.target is not transfer, "two collectives on one edge"
            else:
                assert layout_of(arg, groups) == layout_of(node, groups, arg), f"{arg.name} -> {node.name} moves without a collective"


@settings(max_examples=8, deadline=None)
@given(placements)
def test_bytes_equal_the_sizes_of_the_values_moved(case):
    compiled = compile_grpo(*case)
    sizes = compiled.options.concrete(8)
    by_index = {step.index: step for step in compiled.plan.steps}
    for node in compiled.program.graph.nodes:
        if node.target is transfer:
            step = by_index[node.meta["step"]]
            assert step.bytes == value_bytes(node.args[0].meta["spec"], sizes)
    rollouts = sum(spec.nbytes(sizes) for _, spec in S.ROLLOUTS.fields)
    assert any(t.bytes == rollouts for t in compiled.plan.transfers())


@settings(max_examples=8, deadline=None)
@given(placements)
def test_stages_respect_data_dependencies(case):
    compiled = compile_grpo(*case)
    position = {}
    for step in compiled.plan.steps:
        names = step.nodes if isinstance(step, Stage) else [n.name for n in compiled.program.graph.nodes if n.meta.get("step") == step.index]
        for name in names:
            position[name] = step.index
    for node in compiled.program.graph.nodes:
        if node.name in position:
            for arg in node.all_input_nodes:
                assert position.get(arg.name, -1) <= position[node.name], f"{node.name} runs before its input {arg.name}"


@settings(max_examples=8, deadline=None)
@given(placements)
def test_json_round_trip_is_the_identity(case):
    plan = compile_grpo(*case).plan
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.as_text() == plan.as_text()


def test_plan_shows_roles_collectives_and_memory():
    text = compile_grpo("gpu:8", rg.split({"policy": 4, "rollout": 4, "ref": "policy"})).as_text()
    assert "rollout   ranks 4-7    generate: tp=1 dp=4" in text
    assert "policy    ranks 0-3    train: fsdp2 shard=4 ckpt" in text
    assert "sync_weights policy@v  policy[fsdp2 shard=4 ckpt] -> rollout[tp=1 dp=4]" in text
    assert "send_recv  generate:Rollouts[N,T]  rollout -> ref  8.75 MiB" in text
    assert "32 micro-batch(es) of 4 rows/rank" in text


def test_diff_of_two_plans_names_what_changed():
    a = compile_grpo("gpu:8", rg.colocated()).plan
    b = compile_grpo("gpu:8", rg.colocated(tp=2)).plan
    diff = a.diff(b)
    assert "-" in diff and "tp=2 dp=4" in diff



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
    eager interpreter (plain ops). Float rounding only: loss rel 1e-5, parameters atol 1e-6. With
    micro-batches the kernels must receive the mini-batch's global counts to agree."""
    results = []
    for runner in ("eager", "plan"):
        executor = make_executor(reward=parity_reward)
        worker = executor.models["policy"]
        worker.optimizer = torch.optim.SGD(worker.model.parameters(), lr=0.1)  # the step is the gradient: no Adam sign noise
        hparams = dict(n=4, max_new_tokens=4, micro_batch_size=micro)
        program = grpo.trace(**hparams)
        if runner == "plan":
            compiled = rg.compile(grpo, mesh="cpu:1", placement=rg.colocated(offload=False, checkpointing=False),
                                  sizes={"B": 4, "P": 8, "T": 4}, **hparams)
            assert "fused_ppo_clip (in loss)" in compiled.as_text() and "fused_group_normalize" in compiled.as_text()
            interpreter = PlanRunner(compiled, executor)
        else:
            interpreter = Interpreter(executor)
        metrics = [interpreter.run(program, prompts(4, offset=4 * i))[1] for i in range(2)]
        results.append((metrics, params_of(executor)))
    (eager_metrics, eager_params), (plan_metrics, plan_params) = results
    for eager, plan in zip(eager_metrics, plan_metrics):
        assert eager.keys() == plan.keys()
        for key in eager:
            assert plan[key] == pytest.approx(eager[key], rel=1e-5, abs=1e-7), key
    for a, b in zip(eager_params, plan_params):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_golden_grpo_plan():
    """Pins the printed GRPO plan (split 4+4, Llama-3-8B); regenerate deliberately when the plan changes."""
    from pathlib import Path

    golden = (Path(__file__).parent / "golden_grpo_split.txt").read_text()
    assert compile_grpo("gpu:8", rg.split({"policy": 4, "rollout": 4, "ref": "policy"})).as_text() + "\n" == golden
