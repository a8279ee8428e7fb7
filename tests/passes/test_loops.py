"""The `loops` pass and the refill loop in the plan: text, JSON, dot, stage boundaries."""

import rlgraph as rg
from rlgraph.algorithms import dapo, grpo
from rlgraph.plan.plan import Plan, Stage

SIZES = {"B": 64, "P": 512, "T": 1024}


def compile_dapo(placement=None):
    return rg.compile(dapo, mesh="gpu:8", placement=placement or rg.split({"policy": 4, "rollout": 4}),
                      sizes=dict(SIZES, n=8), models={"policy": "llama3-8b"}, n=8, max_rounds=3, micro_batch_size=4)


def test_the_plan_shows_the_refill_loop_over_generation_and_scoring():
    compiled = compile_dapo()
    text = compiled.as_text()
    (loop,) = compiled.plan.loops
    assert f"loop: steps {loop.steps[0]}-{loop.steps[-1]} repeat on fresh prompts until B=64 groups are kept " \
           f"(filter_groups at step {loop.filter_step}, <= 3 rounds;" in text
    steps = {step.index: step for step in compiled.plan.steps}
    looped = [steps[index] for index in loop.steps]
    assert any(isinstance(s, Stage) and s.phase == "generate" and "generate=generate" in s.ops for s in looped)
    assert any(isinstance(s, Stage) and s.phase == "reward" for s in looped)
    assert steps[0].text().startswith("[0] sync_weights") and 0 not in loop.steps  # weights sync once, not per round
    assert steps[loop.filter_step].phase == "filter" and steps[loop.filter_step].group == "controller"
    assert not any(isinstance(s, Stage) and s.phase == "train" for s in looped)


def test_loop_stages_hold_only_loop_nodes():
    compiled = compile_dapo(rg.colocated())
    (region,) = compiled.program.annotations["loops"]
    (loop,) = compiled.plan.loops
    for step in compiled.plan.stages():
        inside = {name in region.nodes for name in step.nodes}  # reads too: they never join a stage across the loop's edge
        assert inside == {step.index in loop.steps}, step.text()


def test_the_loop_survives_json_and_draws_as_a_back_edge():
    plan = compile_dapo().plan
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.as_text() == plan.as_text()
    (loop,) = plan.loops
    assert f"s{loop.filter_step} -> s{loop.steps[0]} [style=dashed" in plan.to_dot()


def test_programs_without_a_filter_have_no_loop():
    compiled = rg.compile(grpo, mesh="gpu:8", sizes=dict(SIZES, n=8), n=8)
    assert compiled.plan.loops == () and "loop:" not in compiled.as_text()
    assert "loops" not in compiled.program.annotations
