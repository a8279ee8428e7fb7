"""LoRA on the FSDP2 workers (spmd: 2 gloo worker processes; ray: 2 actors) against the local runtime.

The policy is the peft model, FSDP2-sharded; only its adapters train. The KL reference is the
policy's sharded module with the adapters off (no second copy of the base); the generation
engines get merged weights (W + B A * scale) under the plain model's names; a checkpoint holds the
adapters (and their optimizer state) only. Multi-process tests start one transport each (~7 s).
"""

from __future__ import annotations

import pytest
import torch

import rlgraph as rg
from rlgraph.algorithms import ALGORITHMS
from rlgraph.backends.fsdp.build import check_views
from rlgraph.backends.local.state import LMWorker
from rlgraph.backends.local.executor import LocalExecutor
from rlgraph.backends.local.models import load_tokenizer
from rlgraph.backends.lora import merged_state_dict, reference_of, trainable_state
from rlgraph.backends.protocols import ModelRef
from rlgraph.backends.world import RoleSpec, WorldSpec
from rlgraph.errors import ConfigError
from rlgraph.runtime.plan_runner import PlanRunner
from rlgraph.runtime.spmd import SpmdTransport
from rlgraph.runtime.transport import SyncRoute
from rlgraph.testing.tiny import length_parity_reward, tiny_prompts

from tests.helpers import (assert_same_metrics, assert_same_training, assert_spmd_resume_is_exact, checkpoint_worker,
                           state_of)
from tests.runtime.test_spmd import _step_both
from tests.train.test_run import CLOCK, make_config, metrics_of, policy_weights

TOKENS = 4
LORA = {"r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ("q_proj", "v_proj")}
COLOCATED = rg.colocated(offload=False, checkpointing=False)


def _world(lr: float = 1e-2) -> WorldSpec:
    return WorldSpec({"policy": RoleSpec(optimizer="adamw", lr=lr, lora=LORA), "ref": RoleSpec(base_of="policy")},
                     {"reward": length_parity_reward}, max_new_tokens=TOKENS)


def _compile(placement=COLOCATED):
    return rg.compile(ALGORITHMS["grpo"], mesh="cpu:2", placement=placement, sizes={"B": 4, "P": 8, "T": TOKENS},
                      max_new_tokens=TOKENS, n=4, kl=0.1, lora={"policy": LORA})


def _base(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: value for name, value in state.items() if ".lora_" not in name}


# -- the recipe (no processes) ---------------------------------------------------------------------
def test_a_lora_role_spec_builds_seeded_adapters_over_the_base_and_trains_only_them():
    tokenizer = load_tokenizer()
    one, two = (RoleSpec(optimizer="adamw", lora=LORA, seed=3).build_module(tokenizer) for _ in range(2))
    assert all(torch.equal(value, two.state_dict()[name]) for name, value in one.state_dict().items())  # every rank alike
    other = RoleSpec(optimizer="adamw", lora=LORA, seed=4).build_module(tokenizer)
    a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert not torch.equal(one.state_dict()[a], other.state_dict()[a])
    trainable = {name for name, param in one.named_parameters() if param.requires_grad}
    assert trainable == set(trainable_state(one)) and all(".lora_" in name for name in trainable)
    optimizer = RoleSpec(optimizer="adamw", lora=LORA).build_optimizer(one.parameters())
    assert len(optimizer.param_groups[0]["params"]) == len(trainable) == 8  # A and B of q, v in 2 layers
    plain = RoleSpec(lora=LORA, seed=3).build_module(tokenizer, merged=True)  # what an engine serves
    assert not any("lora" in name for name in plain.state_dict())
    assert all(torch.equal(value, plain.state_dict()[name]) for name, value in merged_state_dict(one).items())


def test_of_executor_sends_the_lora_policy_and_its_reference_as_a_view():
    tokenizer = load_tokenizer()
    policy = RoleSpec(optimizer="adamw", lora=LORA, seed=1).build_module(tokenizer)
    with torch.no_grad():
        next(p for name, p in policy.named_parameters() if "lora_B" in name).add_(0.5)  # trained adapters travel
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.0)
    executor = LocalExecutor({"policy": LMWorker(policy, optimizer), "ref": LMWorker(reference_of(policy))}, {}, tokenizer)
    world = WorldSpec.of_executor(executor, {})
    spec = world.roles["policy"]
    assert spec.lora == {**LORA, "target_modules": ("q_proj", "v_proj")} and spec.lr == 1e-3
    assert spec.optimizer_options["weight_decay"] == 0.0  # not torch's default 0.01: the run's hyper-parameters
    assert world.roles["ref"].base_of == "policy" and world.roles["ref"].weights is None
    rebuilt = world.build_local()
    state = rebuilt.models["policy"].model.state_dict()
    assert all(torch.equal(state[name], value) for name, value in policy.state_dict().items())
    assert list(rebuilt.models["ref"].model.parameters()) == [] and rebuilt.models["ref"].optimizer is None


def test_a_reference_placed_away_from_the_lora_policy_is_refused_naming_the_placement(tmp_path):
    away = _compile(rg.split({"policy": 1, "rollout": 1, "ref": "rollout"}))
    with pytest.raises(ValueError, match=r"'ref' is role 'policy' with its LoRA adapters off.*ranks of 'policy', \[0\].*ranks \[1\]"):
        check_views(_world().views(), away.plan)
    check_views(_world().views(), _compile(rg.split({"policy": 1, "rollout": 1, "ref": "policy"})).plan)  # shares: fine
    config, _ = make_config(tmp_path, "away", ["model.lora={r: 4}", "runtime.runtime=spmd", "runtime.nproc=2",
                                               "runtime.placement=split:policy=1,rollout=1,ref=rollout",
                                               "warm_start.steps=0", "train.steps=1"])
    from rlgraph.train.run import dry_run, train

    for run in (dry_run, train):  # refused with the plan, before any model, warm start or worker
        with pytest.raises(ConfigError, match=r"runtime.placement 'split:policy=1,rollout=1,ref=rollout'.*colocated"):
            run(config)
    assert not (tmp_path / "away").exists()


# -- two worker processes ----------------------------------------------------------------------------
@pytest.mark.slow
def test_grpo_with_kl_on_a_lora_policy_on_two_fsdp_ranks_matches_local():
    world = _world()
    compiled = _compile()
    local_executor = world.build_local()
    start = state_of(local_executor.models["policy"])
    with SpmdTransport(compiled.plan, world, device="cpu") as transport:
        for step in range(3):
            prompts = tiny_prompts(4, 4 * step)
            local, spmd = _step_both(compiled, local_executor, transport, world, prompts)
            assert_same_metrics(local, spmd)
        assert spmd["policy/kl"] > 1e-4 and spmd["policy/grad_norm"] > 0  # the reference differs from the policy
        trained = transport.pull_state("policy")
        assert_same_training(local_executor.models["policy"], trained, start, steps=3)
        assert all(torch.equal(trained[name], value) for name, value in _base(start).items())  # the base: bit-identical
        assert max(float((trained[name] - start[name]).abs().max()) for name in trainable_state(
            local_executor.models["policy"].model)) > 1e-3  # the adapters trained
        reports = transport.weights_report("policy")
        adapters = sum(value.numel() for value in trainable_state(local_executor.models["policy"].model).values())
        for report in reports.values():  # the base is held once, whole, and the engine runs on it; the adapters are sharded
            assert report["global_numel"] - report["local_numel"] == adapters // 2 and report["served"] == 2
            adapted = sum(param.numel() for name, param in local_executor.models["policy"].model.named_parameters()
                          if name.endswith(".base_layer.weight"))  # q, v of each layer: the engine's own, merged weights
            assert report["engine_numel"] - report["engine_shared_numel"] == adapted, report
        live = ModelRef("policy", 3)
        transport.begin({0: {"model": live}, 1: {"model": live}})
        transport.sync_weights("synced", "model", SyncRoute("policy", (0, 1), (0, 1), buckets=40, bucket_bytes=16 << 10))
        assert all(r["served"] == 3 and r["engine_diff"] == 0.0 for r in transport.weights_report("policy").values())


@pytest.mark.slow
def test_a_split_placement_trains_lora_on_rank_0_and_serves_merged_weights_on_rank_1_like_local():
    world = _world()
    compiled = _compile(rg.split({"policy": 1, "rollout": 1, "ref": "policy"}))
    assert any(t.kind == "send_recv" for t in compiled.plan.transfers())
    local_executor = world.build_local()
    before = state_of(local_executor.models["policy"])
    with SpmdTransport(compiled.plan, world, device="cpu") as transport:
        for step in range(2):
            local, spmd = _step_both(compiled, local_executor, transport, world, tiny_prompts(4, 4 * step))
            assert_same_metrics(local, spmd)
        assert_same_training(local_executor.models["policy"], transport.pull_state("policy"), before, steps=2)
        reports = transport.weights_report("policy")
        assert reports[1]["served"] == 1 and "local_numel" not in reports[1]  # rank 1 only generates


@pytest.mark.slow
def test_a_spmd_lora_checkpoint_holds_the_adapters_only_and_resumes_exactly_on_spmd_and_on_local_and_back(tmp_path):
    from rlgraph.train.checkpoint import load_checkpoint, save_checkpoint

    lr = 1e-2
    world, compiled = _world(lr), _compile()
    first, second = tiny_prompts(4), tiny_prompts(4, 4)
    with SpmdTransport(compiled.plan, world, device="cpu") as transport:
        runner = PlanRunner(compiled, transport, controller=world.controller())
        runner.run(first)
        state = runner.export_state()
        path = save_checkpoint(tmp_path, 1, state, {})
        uninterrupted = runner.run(second)[1]
        final = transport.pull_state("policy")
    policy = state.roles["policy"]
    assert set(policy.model) == {name for name in final if ".lora_" in name} and len(policy.model) == 8
    assert len(policy.optimizer["state"]) == 8 and state.roles["ref"].model == {} and state.roles["ref"].optimizer is None
    assert_spmd_resume_is_exact(compiled, world, path, second, uninterrupted, final)  # the same runtime: exact
    local_executor = world.build_local()
    local = PlanRunner(compiled, local_executor)
    load_checkpoint(path, local)  # resumed in one process: the same step, up to float rounding
    resumed_from = state_of(local_executor.models["policy"])
    assert_same_metrics(uninterrupted, local.run(second)[1])
    assert_same_training(local_executor.models["policy"], final, resumed_from, steps=1)
    path = save_checkpoint(tmp_path / "local", 2, local.export_state(), {})  # and back: a local checkpoint on spmd
    third = tiny_prompts(4, 8)
    resumed_from = state_of(local_executor.models["policy"])
    after_local = local.run(third)[1]
    with SpmdTransport(compiled.plan, world, device="cpu") as transport:
        resumed = PlanRunner(compiled, transport, controller=world.controller())
        load_checkpoint(path, resumed)
        assert_same_metrics(after_local, resumed.run(third)[1])
        assert_same_training(local_executor.models["policy"], transport.pull_state("policy"), resumed_from, steps=1)


@pytest.mark.slow
def test_rlgraph_train_with_lora_on_spmd_matches_local_and_resumes_on_the_local_runtime(tmp_path):
    """`rlgraph train` with model.lora and a KL reference: a warm-started (SFT) LoRA policy, 2 GRPO
    steps on 2 worker processes, against the same config in one process; then resumed locally."""
    from rlgraph.train.run import load_run_config, train

    common = ["model.lora={r: 4, target_modules: [q_proj, v_proj]}", "train.steps=2", "warm_start.steps=2",
              "checkpoint.every=1", "eval.every=2"]
    train(make_config(tmp_path, "local", common)[0])
    train(make_config(tmp_path, "spmd", [*common, "runtime.runtime=spmd", "runtime.nproc=2"])[0])
    local, spmd = metrics_of(tmp_path / "local"), metrics_of(tmp_path / "spmd")
    assert [row["step"] for row in spmd] == [row["step"] for row in local] and any("policy/kl" in row for row in spmd)
    for a, b in zip(local, spmd):
        assert_same_metrics(a, b)
    weights = policy_weights(tmp_path / "spmd")
    assert weights and all(".lora_" in name for name in weights)  # adapters only
    # 2 GRPO steps of AdamW at optimizer.lr (1e-3) from the same warm-started weights (the warm start runs in-process)
    assert_same_training(checkpoint_worker(tmp_path / "local", lr=1e-3), weights, None, steps=2, trainable_only=True)
    resumed = load_run_config(tmp_path / "spmd", ["train.steps=3", "runtime.runtime=local"])
    assert train(resumed, resume=True).steps == 3
    assert [row["step"] for row in metrics_of(tmp_path / "spmd") if "reward" in row] == [1, 2, 3]
    assert not any(key.startswith(CLOCK) for key in spmd[0])


@pytest.mark.slow
def test_grpo_with_kl_on_a_lora_policy_on_two_ray_actors_matches_local():
    ray = pytest.importorskip("ray", reason="the ray runtime is the optional extra rlgraph[ray]")
    from rlgraph.runtime.ray_transport import RayTransport

    world, compiled = _world(), _compile()
    local_executor = world.build_local()
    before = state_of(local_executor.models["policy"])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with RayTransport(compiled.plan, world, device="cpu") as transport:
            for step in range(2):
                local, remote = _step_both(compiled, local_executor, transport, world, tiny_prompts(4, 4 * step))
                assert_same_metrics(local, remote)
            assert_same_training(local_executor.models["policy"], transport.pull_state("policy"), before, steps=2)
    finally:
        ray.shutdown()
