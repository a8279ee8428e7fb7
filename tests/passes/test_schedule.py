"""The `schedule` pass: stages hold one kind of work, reads never pose as work, offload only around
the stages that generate and update, and the printed steps of GRPO on two CPU ranks."""

import operator

import pytest

import rlgraph as rg
import rlgraph.testing as rgt
from rlgraph.algorithms import ALGORITHMS, grpo, ppo
from rlgraph.ir import specs as S
from rlgraph.ir.primitives import GENERATORS, primitive_name
from rlgraph.ir.infer import get_field
from rlgraph.plan.plan import Offload, Stage

SIZES = {"B": 32, "P": 8, "T": 5, "n": 8}
PLACEMENTS = {"colocated": rg.colocated(), "split": rg.split({"policy": 1, "rollout": 1, "ref": "policy", "critic": "policy", "teacher": "policy"})}


def is_read(node) -> bool:
    """A record field read, or one output of a multi-output primitive (a getitem of a non-tensor)."""
    return node.target is get_field or (node.target is operator.getitem and not isinstance(node.args[0].meta["spec"], S.TensorSpec))


def stages_with_nodes(compiled):
    nodes = {node.name: node for node in compiled.program.graph.nodes}
    return [(stage, [nodes[name] for name in stage.nodes]) for stage in compiled.plan.stages()]


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_a_stage_of_reads_only_is_a_fields_stage_and_no_other_stage_is(name, placement):
    compiled = rg.compile(ALGORITHMS[name], mesh="cpu:2", placement=PLACEMENTS[placement], sizes=SIZES)
    rgt.assert_plan_invariants(compiled)
    region = {n for loop in compiled.program.annotations.get("loops", ()) for n in loop.nodes}
    for stage, nodes in stages_with_nodes(compiled):
        assert (stage.phase == "fields") == all(map(is_read, nodes)), stage.text()
        assert {node.meta["role"] for node in nodes} == {stage.group}, stage.text()
        assert len({node.name in region for node in nodes}) == 1, stage.text()


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_offload_comes_right_before_generate_and_onload_right_before_update(name):
    compiled = rg.compile(ALGORITHMS[name], mesh="cpu:2", placement=rg.colocated(offload=True), sizes=SIZES)
    steps = compiled.plan.steps
    nodes = {node.name: node for node in compiled.program.graph.nodes}
    wanted = {"offload": set(GENERATORS), "onload": {"update"}}  # generate, or a multi-turn rollout
    directions = []
    for step, after in zip(steps, steps[1:]):
        if isinstance(step, Offload):
            assert isinstance(after, Stage), after.text()
            assert wanted[step.direction] & {primitive_name(nodes[n]) for n in after.nodes}, f"{step.text()} before {after.text()}"
            directions.append(step.direction)
    trains = any(primitive_name(node) == "update" for node in nodes.values())
    generates = any(primitive_name(node) in GENERATORS for node in nodes.values())
    assert directions == (["offload", "onload"] if trains and generates else [])


def test_ppo_70b_moves_optimizer_state_once_each_way_per_iteration():
    """The brief's case: a stage that only read `ro.logprobs` was labelled `generate` and paid
    an offload and an onload of 28.75 GiB each. (On 4x8 H100s it does not fit: the critic's state
    stays on the device beside the policy's; H200s hold it.)"""
    compiled = rg.compile(ppo, mesh="4x8:h200", placement=rg.colocated(tp=8), models={"policy": "llama3-70b"},
                          sizes={"B": 32, "P": 64, "T": 256, "n": 1})
    lines = [line for line in compiled.as_text().splitlines() if "optimizer+grads" in line]
    assert lines == ["  [2] offload    @policy    optimizer+grads 28.75 GiB; vllm wakes kv_cache",
                     "  [17] onload     @policy    optimizer+grads 28.75 GiB; vllm sleeps (weights+kv_cache)"]
    assert "[3] generate   @policy    generate=generate" in compiled.as_text()
    assert "[18] train      @policy    update=update" in compiled.as_text()


def steps_text(compiled) -> str:
    text = compiled.as_text()
    return text[text.index("steps:\n") + 7:text.index("memory per rank")]


def compile_grpo(placement):
    return rg.compile(grpo, mesh="cpu:2", placement=placement, sizes={"B": 32, "P": 8, "T": 5}, n=8)


def test_grpo_colocated_steps():
    """Reads join the work they feed (`.logprobs` and `.mask` with `update`); `.group`, read between
    the reward and a scatter, is a `fields` stage."""
    assert steps_text(compile_grpo(rg.colocated(offload=False, checkpointing=False))) == """\
  [0] sync_weights policy@v  policy[fsdp2 shard=2] -> policy[native tp=1 dp=2]  494.0 KiB in 1 bucket(s)
  [1] scatter    prompts:Prompts[B,P]  controller -> policy  2.2 KiB
  [2] generate   @policy    generate=generate
          256 samples (32 prompts x n=8), <= 5 new tokens; 2 replica(s) x tp=1, 128 sequences each | ~8.64e+08 FLOP
  [3] gather     generate:Rollouts[N,T]  policy -> controller  36.2 KiB
  [4] reward     @controller mask_1=.mask  score=score
  [5] fields     @policy    group=.group
  [6] scatter    score:f32[N]  controller -> policy  1.0 KiB
  [7] math       @policy    group_normalize=group_normalize  getitem=getitem
          kernels: fused_group_normalize
  [8] train      @policy    logprobs=.logprobs  mask=.mask  update=update
          loss loss: 1 epoch(s) x 1 minibatch(es) x 1 micro-batch(es) of 128 rows/rank; grad clip 1.0 | kernels: fused_ppo_clip (in loss) | ~2.59e+09 FLOP
  [9] controller @controller rollout_stats=rollout_stats
"""


def test_grpo_split_steps():
    """With no work after them on their group, reads join the stage before them (`[7]`), else
    they are a `fields` stage (`[9]`, between two transfers)."""
    assert steps_text(compile_grpo(rg.split({"policy": 1, "rollout": 1}))) == """\
  [0] sync_weights policy@v  policy[fsdp2 shard=1 ckpt] -> rollout[native tp=1 dp=1]  494.0 KiB in 1 bucket(s)
  [1] scatter    prompts:Prompts[B,P]  controller -> rollout  2.2 KiB
  [2] generate   @rollout   generate=generate
          256 samples (32 prompts x n=8), <= 5 new tokens; 1 replica(s) x tp=1, 256 sequences each | ~8.64e+08 FLOP
  [3] gather     generate:Rollouts[N,T]  rollout -> controller  36.2 KiB
  [4] reward     @controller mask_2=.mask  score=score
  [5] fields     @rollout   group=.group
  [6] scatter    score:f32[N]  controller -> rollout  1.0 KiB
  [7] math       @rollout   group_normalize=group_normalize  getitem=getitem
          kernels: fused_group_normalize
  [8] send_recv  generate:Rollouts[N,T]  rollout -> policy  36.2 KiB
  [9] fields     @policy    mask_1=.mask  logprobs_1=.logprobs
  [10] send_recv  getitem:f32[N,1]  rollout -> policy  1.0 KiB
  [11] train      @policy    update=update
          loss loss: 1 epoch(s) x 1 minibatch(es) x 1 micro-batch(es) of 256 rows/rank; grad clip 1.0 | kernels: fused_ppo_clip (in loss) | ~2.59e+09 FLOP
  [12] controller @controller rollout_stats=rollout_stats
"""


def test_the_outputs_of_update_stay_in_its_stage_unprinted():
    compiled = compile_grpo(rg.colocated())
    (train,) = [stage for stage in compiled.plan.stages() if stage.phase == "train"]
    update = next(node for node in compiled.program.graph.nodes if primitive_name(node) == "update")
    assert {user.name for user in update.users} <= set(train.nodes)
    assert train.ops == ("logprobs=.logprobs", "mask=.mask", "update=update")


def test_fields_stages_run_the_same_as_eager_on_both_placements():
    from tests.helpers import prompts

    for placement in (rg.split({"policy": 1, "rollout": 1}, checkpointing=False), rg.colocated(checkpointing=False)):
        rgt.assert_compiled_matches_eager(grpo, executor=rgt.tiny_executor, batches=[prompts(4)], mesh="cpu:2",
                                          placement=placement, sizes={"B": 4, "P": 8, "T": 4}, n=4, max_new_tokens=4)
