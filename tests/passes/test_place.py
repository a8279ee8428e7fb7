"""The `place` pass and the generation engine: every generation layout names the engine that runs
it, and a layout no engine can run is refused at compile time, naming the role and the option."""

import json

import pytest

import rlgraph as rg
from rlgraph.algorithms import grpo
from rlgraph.passes.options import CompileOptions
from rlgraph.passes.place import PlacementConfigError
from rlgraph.plan.mesh import GenerateLayout, Group, Mesh, TrainLayout
from rlgraph.plan.plan import Plan

SIZES = {"B": 8, "P": 8, "T": 4}


def compile_grpo(mesh="cpu:2", placement=None, **options):
    return rg.compile(grpo, mesh=mesh, placement=placement or rg.colocated(), sizes=SIZES, n=2, **options)


@pytest.mark.parametrize(("mesh", "engine", "wanted"), [
    ("cpu:2", "auto", "native"), ("gpu:8", "auto", "vllm"), ("gpu:8", "native", "native"), ("gpu:8", "vllm", "vllm"),
    ("cpu:2", "native", "native"),
])
def test_auto_is_native_on_cpu_and_vllm_on_gpus(mesh, engine, wanted):
    options = CompileOptions(Mesh.parse(mesh), engine=engine)
    assert options.generation_engine == wanted
    (policy,) = compile_grpo(mesh, engine=engine).plan.groups
    assert policy.generate.engine == wanted


def test_the_printed_layout_names_the_engine():
    assert "generate: native tp=1 dp=2" in compile_grpo().as_text()
    text = compile_grpo("gpu:8", rg.colocated(tp=2)).as_text()
    assert "policy    ranks 0-7    train: fsdp2 shard=8 ckpt; generate: vllm tp=2 dp=4" in text
    assert "-> policy[vllm tp=2 dp=4]" in text  # the weight sync's destination layout


def test_tensor_parallel_generation_on_the_native_engine_is_refused():
    with pytest.raises(PlacementConfigError) as error:
        compile_grpo("cpu:2", rg.colocated(tp=2))
    assert str(error.value) == (
        "role 'policy': generate tp=2 needs an engine with tensor parallelism; the native engine runs tp=1 only "
        "(engine='auto' on the mesh 1x2 cpu)\n"
        "  fix: rg.colocated(tp=1) (--placement colocated:tp=1), or engine='vllm' (--engine vllm) on a GPU mesh")


def test_the_refusal_names_the_generator_role_and_the_placement_it_came_from():
    with pytest.raises(PlacementConfigError, match=r"role 'rollout': generate tp=2 .*engine='native' on the mesh 1x8 h100\)"
                       r"\n  fix: rg.split\(\{...\}, tp=1\)"):
        compile_grpo("gpu:8", rg.split({"policy": 4, "rollout": 4}, tp=2), engine="native")
    explicit = rg.explicit(Group("policy", (0, 1), TrainLayout(2), GenerateLayout(tp=2, dp=1)))
    with pytest.raises(PlacementConfigError, match=r"fix: GenerateLayout\(tp=1, dp=2\) for group 'policy'"):
        compile_grpo("cpu:2", explicit)


def test_native_runs_tp1_on_gpus():
    (policy,) = compile_grpo("gpu:8", engine="native").plan.groups
    assert str(policy.generate) == "native tp=1 dp=8"


def test_vllm_on_a_cpu_mesh_needs_no_offload_and_the_plan_says_the_engine_stays_resident():
    with pytest.raises(PlacementConfigError) as error:
        compile_grpo("cpu:2", engine="vllm")  # colocated() offloads: the engine would have to sleep
    assert str(error.value) == (
        "engine='vllm' on the mesh 1x2 cpu with colocated offload=True: an offload step puts the vLLM engine to "
        "sleep while the trainer runs, and vLLM has no sleep mode on CPU\n"
        "  fix: colocated(offload=False) (--placement colocated:offload=False): the engine stays resident beside "
        "the trainer, as host memory allows")
    plan = compile_grpo("cpu:2", rg.colocated(offload=False), engine="vllm").plan
    assert str(plan.groups[0].generate) == "vllm tp=1 dp=2" and not any("offload" in step.text() for step in plan.steps)
    assert any(note.startswith("vllm on cpu: no sleep mode") for note in plan.notes)


def test_offload_steps_say_what_they_do_to_a_vllm_engine():
    texts = [step.text() for step in compile_grpo("gpu:8", engine="vllm").plan.steps]
    assert any("offload" in text and text.endswith("; vllm wakes kv_cache") for text in texts)
    assert any("onload" in text and text.endswith("; vllm sleeps (weights+kv_cache)") for text in texts)
    native = [step.text() for step in compile_grpo("gpu:8", engine="native").plan.steps]
    assert not any("vllm" in text for text in native)


@pytest.mark.parametrize(("engine", "hint"), [
    ("vlm", "; did you mean 'vllm'?"), ("VLLM", "; did you mean 'vllm'?"), ("Native", "; did you mean 'native'?"),
    ("", ""), (None, ""), (2, ""),
])
def test_an_unknown_engine_lists_the_choices(engine, hint):
    with pytest.raises(PlacementConfigError) as error:
        compile_grpo("gpu:8", engine=engine)
    assert str(error.value) == f"unknown generation engine {engine!r}: choose one of 'auto', 'native', 'vllm'{hint}"


def test_an_explicit_layout_may_name_its_engine_but_not_against_the_option():
    def explicit(engine):
        return rg.explicit(Group("policy", (0, 1), TrainLayout(2), GenerateLayout(tp=2, dp=1, engine=engine)))

    (policy,) = compile_grpo("gpu:2", explicit("vllm")).plan.groups
    assert str(policy.generate) == "vllm tp=2 dp=1"
    with pytest.raises(PlacementConfigError, match="its layout names engine 'vllm', but engine='native' was asked for"):
        compile_grpo("gpu:2", explicit("vllm"), engine="native")
    with pytest.raises(PlacementConfigError, match=r"\(its layout names engine 'native'\)"):
        compile_grpo("gpu:2", explicit("native"))
    with pytest.raises(PlacementConfigError, match="unknown generation engine 'vlm'"):
        compile_grpo("gpu:2", explicit("vlm"))


@pytest.mark.parametrize("tp", ["2", 0, 1.5])
def test_a_tp_that_is_not_a_divisor_says_which_are(tp):
    with pytest.raises(PlacementConfigError, match=rf"tp={tp!r} does not divide; tp must be one of \[1, 2, 4, 8\]"):
        compile_grpo("gpu:8", rg.colocated(tp=tp))


def test_the_engine_survives_json():
    plan = compile_grpo("gpu:8", rg.split({"policy": 4, "rollout": 4}, tp=2)).plan
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.group("rollout").generate == GenerateLayout(2, 2, "vllm")
    old = json.loads(plan.to_json())  # a plan written before layouts named their engine
    for group in old["groups"]:
        if group["generate"]:
            del group["generate"]["engine"]
    assert Plan.from_json(json.dumps(old)).group("rollout").generate == GenerateLayout(2, 2)


@pytest.mark.parametrize("groups, message", [
    ({"policy": 4, "rolout": 4}, "group 'rolout' is no role; did you mean 'rollout'?"),
    ({"policy": 4, "rollout": 4, "refs": "policy"}, "group 'refs' is no role; did you mean 'ref'?"),
    ({"polcy": 4, "rollout": 4}, "group 'polcy' is no role; did you mean 'policy'?"),
])
def test_split_group_that_is_no_role_gets_a_did_you_mean(groups, message):
    with pytest.raises(PlacementConfigError, match=message):
        compile_grpo("gpu:8", rg.split(groups))


@pytest.mark.parametrize("groups, message", [
    ({"policy": [0, 1, 2, 3], "rollout": [3, 4, 5, 6]}, "rank 3 is given to both 'policy' and 'rollout'"),
    ({"policy": [0, 0, 1, 2], "rollout": [4, 5, 6, 7]}, "group 'policy' lists a rank twice"),
    ({"policy": 4, "rollout": [0, 1, 2, 3]}, "rank 0 is given to both 'policy' and 'rollout'"),
    ({"policy": 4, "rollout": 4.0}, "give a count of ranks, a list of ranks or the name of a group"),
])
def test_split_ranks_overlapping_or_repeated_are_refused(groups, message):
    with pytest.raises(PlacementConfigError, match=message):
        compile_grpo("gpu:8", rg.split(groups))


@pytest.mark.parametrize("fsdp", [0, -2, 3])
def test_colocated_fsdp_that_does_not_divide_is_refused_not_replaced(fsdp):
    with pytest.raises(PlacementConfigError, match=f"fsdp={fsdp} does not divide"):
        compile_grpo("gpu:8", rg.colocated(fsdp=fsdp))


@pytest.mark.parametrize("models, message", [({"polcy": "llama3-8b"}, "did you mean 'policy'"),
                                             ({"Policy": "llama3-8b"}, "did you mean 'policy'"),
                                             ({"actor": "llama3-8b"}, "'actor' is no role")])
def test_a_misspelt_role_in_models_is_refused(models, message):
    with pytest.raises(PlacementConfigError, match=message):
        compile_grpo("gpu:8", models=models)


def test_a_known_role_the_program_does_not_run_may_be_named():
    compile_grpo("gpu:8", rg.split({"policy": 4, "rollout": 4, "critic": "policy"}), models={"critic": "tiny-qwen2"})


@pytest.mark.parametrize("value", ["yes", 2, None])
@pytest.mark.parametrize(("make", "where"), [
    (lambda value: rg.colocated(cpu_offload=value), "rg.colocated"),
    (lambda value: rg.split({"policy": 4, "rollout": 4}, cpu_offload=value), "rg.split"),
    (lambda value: rg.explicit(Group("policy", tuple(range(8)), TrainLayout(8, cpu_offload=value), GenerateLayout(1, 8))),
     "group 'policy''s TrainLayout"),
])
def test_cpu_offload_must_be_true_or_false(make, where, value):
    with pytest.raises(PlacementConfigError, match=rf"{where}: cpu_offload must be True or False, got {value!r}\n  fix: "):
        compile_grpo("gpu:8", make(value))


def test_cpu_offload_reaches_every_training_layout_and_survives_json():
    plan = compile_grpo("gpu:8", rg.split({"policy": 4, "rollout": 4, "ref": "policy"}, cpu_offload=True), kl=0.1).plan
    assert plan.group("policy").train == TrainLayout(4, 1, True, True) and plan.group("ref").train is None
    assert plan.host_memory.keys() == {"policy"} and plan.memory["policy"]["train"]["params"] == 0
    assert plan.memory["ref"]["infer"]["params"] > 0  # a frozen reference keeps its weights on the device
    again = Plan.from_json(plan.to_json())
    assert again == plan
    old = json.loads(plan.to_json())  # a plan written before cpu_offload and host memory
    del old["host_memory"]
    for group in old["groups"]:
        if group["train"]:
            del group["train"]["cpu_offload"]
    assert Plan.from_json(json.dumps(old)).group("policy").train == TrainLayout(4, 1, True)


def test_cpu_offload_on_a_cpu_mesh_keeps_the_state_in_the_device_figures():
    resident, offloaded = compile_grpo().plan, compile_grpo(placement=rg.colocated(cpu_offload=True)).plan
    assert offloaded.memory == resident.memory and offloaded.host_memory == {}
    assert "cpu_offload: on a cpu mesh the training state is in host memory already" in offloaded.as_text()


# -- grad_sync: when FSDP2 reduce-scatters an accumulation's gradients ----------------------------
def _train_layout_and_memory(grad_sync: str, models=None, mesh="cpu:2", sizes=SIZES, n=2):
    compiled = rg.compile(grpo, mesh=mesh, placement=rg.colocated(grad_sync=grad_sync), models=models or {},
                          sizes=sizes, n=n, micro_batch_size=1)
    return compiled.plan.group("policy").train, compiled.plan.memory["policy"]["train"], compiled


def test_grad_sync_last_costs_exactly_one_unsharded_fp32_gradient_and_shows_in_the_plan():
    from rlgraph.passes.memory_plan import model_shape

    each, each_memory, _ = _train_layout_and_memory("each")
    last, last_memory, compiled = _train_layout_and_memory("last")
    assert (each.grad_sync_last, last.grad_sync_last) == (False, True)
    assert "grad-sync=last-micro" in compiled.plan.as_text()
    # fp32 on a cpu mesh: 4 bytes for every trained parameter, unsharded, held through the backwards
    extra = 4 * model_shape(compiled.options, "policy").n_params
    assert last_memory["workspace"] - each_memory["workspace"] == extra
    assert last_memory["total"] - each_memory["total"] == extra
    update = next(node for node in compiled.program.graph.nodes if node.name.startswith("update"))
    assert update.meta["grad_sync_last"] is True  # what the executor reads with the update's settings


def test_auto_defers_the_sync_only_into_memory_the_plan_reserves_anyway():
    big = {"B": 64, "P": 512, "T": 8192}  # the generator's KV cache is the ranks' peak: the gradient fits under it
    layout, memory, compiled = _train_layout_and_memory("auto", {"policy": "qwen2.5-0.5b"}, "h100:8", big, 8)
    assert layout.grad_sync_last and memory["total"] <= compiled.plan.memory["policy"]["generate"]["total"]
    short = {"B": 64, "P": 512, "T": 2048}  # training is the peak: deferring would raise it, so auto does not
    assert not _train_layout_and_memory("auto", {"policy": "qwen2.5-0.5b"}, "h100:8", short, 8)[0].grad_sync_last
    assert not _train_layout_and_memory("auto")[0].grad_sync_last  # the tiny model: training is its peak too


def test_grad_sync_last_cuts_the_estimated_fsdp_traffic():
    # 4 nodes: the shard group crosses the network and training is bound by FSDP traffic. 512 rows over
    # 32 ranks: 16 micro-batches of 1 row, 3 collectives each -> 2 each + 1 per step: 48 -> 33 (0.69x).
    def train_seconds(sync: str) -> float:
        compiled = rg.compile(grpo, mesh="4x8:h100", placement=rg.colocated(grad_sync=sync, checkpointing=False),
                              models={"policy": "qwen2.5-0.5b"}, sizes={"B": 64, "P": 512, "T": 512}, n=8, micro_batch_size=1)
        (step,) = [step for step in compiled.cost_analysis().steps if step.phase == "train"]
        assert step.why == "FSDP traffic"
        return step.seconds

    assert train_seconds("last") < 0.75 * train_seconds("each")


@pytest.mark.parametrize("bad", ["every", True, None])
def test_a_bad_grad_sync_names_the_choices(bad):
    with pytest.raises(PlacementConfigError, match=r"grad_sync must be one of 'auto', 'each', 'last'"):
        compile_grpo(placement=rg.colocated(grad_sync=bad))
    with pytest.raises(PlacementConfigError, match=r"rg.split: grad_sync"):
        compile_grpo(placement=rg.split({"policy": 1, "rollout": 1, "ref": "policy"}, grad_sync=bad))


# -- trained=: roles another plan trains on the same workers -------------------------------------
def _evaluate(placement, **options):
    from rlgraph.algorithms import evaluate

    return rg.compile(evaluate, mesh=Mesh("cpu", 1, 2), placement=placement, engine="native",
                      sizes={"B": 8, "P": 6, "T": 4, "n": 1}, max_new_tokens=4, **options)


@pytest.mark.parametrize("placement", [rg.colocated(), rg.split({"policy": 1, "rollout": 1})], ids=["colocated", "split"])
def test_a_role_trained_elsewhere_keeps_its_train_layout_and_is_synced_before_generating(placement):
    plain, trained = _evaluate(placement).plan, _evaluate(placement, trained=("policy",)).plan
    assert not [step for step in plain.steps if type(step).__name__ == "SyncWeights"]  # a frozen generator
    policy = next(group for group in trained.groups if group.name == "policy")
    assert policy.train is not None
    syncs = [step for step in trained.steps if type(step).__name__ == "SyncWeights"]
    assert [step.index for step in syncs] == [0] and syncs[0].role == "policy"
    assert "sync_weights policy@v" in trained.as_text()
    # the same ranks and layout as a GRPO plan's policy group: the evaluation can run on its workers
    rl = rg.compile(grpo, mesh=Mesh("cpu", 1, 2), placement=placement, sizes={"B": 2, "P": 6, "T": 4, "n": 2}, kl=0.0)
    assert policy in set(rl.plan.groups)
    assert _evaluate(placement, trained="policy").plan.groups == trained.groups  # one name or several


@pytest.mark.parametrize("trained, message", [
    (("polcy",), r"'polcy' is no role of this program; did you mean 'policy'"),
    ((3,), r"3 is no role of this program"),
    (("ref",), r"'ref' is no role of this program \(it runs policy\)"),
])
def test_a_trained_role_the_program_does_not_read_is_refused(trained, message):
    with pytest.raises(PlacementConfigError, match=message):
        _evaluate(rg.colocated(), trained=trained)
