"""The same compiled plan on the `spmd` transport (2 gloo worker processes, FSDP2) and on `local`.

Each test starts one transport (~5 s: two spawned processes import torch and build their roles)
and runs the local reference beside it, from the same initial weights, on the same prompts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import attrs
import pytest
import torch

import rlgraph as rg
from rlgraph.algorithms import ALGORITHMS
from rlgraph.backends.local.models import build_causal_lm, load_tokenizer
from rlgraph.backends.protocols import ModelRef
from rlgraph.backends.world import RoleSpec, WorldSpec
from rlgraph.plan.plan import Offload
from rlgraph.runtime.errors import PlanInputError, PlanStepError
from rlgraph.runtime.plan_runner import PlanRunner
from rlgraph.runtime.spmd import SpmdTransport
from rlgraph.runtime.transport import SyncRoute
from rlgraph.testing.tiny import length_parity_reward, tiny_prompts

from tests.helpers import assert_same_metrics, assert_same_training, assert_spmd_resume_is_exact, state_of

pytestmark = pytest.mark.slow

TOKENS = 4
COLOCATED = rg.colocated(offload=False, checkpointing=False)


def _compile(name: str, placement=COLOCATED, **hparams):
    return rg.compile(ALGORITHMS[name], mesh="cpu:2", placement=placement, sizes={"B": 4, "P": 8, "T": TOKENS},
                      max_new_tokens=TOKENS, **hparams)


def _world(**roles: RoleSpec) -> WorldSpec:
    return WorldSpec(roles or {"policy": RoleSpec(optimizer="sgd", lr=0.1)}, {"reward": length_parity_reward},
                     max_new_tokens=TOKENS)


def _step_both(compiled, local_executor, transport, world, prompts):
    local = PlanRunner(compiled, local_executor).run(prompts)[1]
    spmd = PlanRunner(compiled, transport, controller=world.controller()).run(prompts)[1]
    return local, spmd


def _matches_local(compiled, world, prompts, *, steps: int = 2, roles=("policy",)) -> dict[int, dict]:
    """`steps` steps on spmd and on local from the same weights: equal metrics each step and equal
    weights after; returns the ranks' weights report of the policy."""
    local_executor = world.build_local()
    before = {role: state_of(local_executor.models[role]) for role in roles}
    with SpmdTransport(compiled.plan, world, device="cpu") as transport:
        for _ in range(steps):
            local, spmd = _step_both(compiled, local_executor, transport, world, prompts)
            assert_same_metrics(local, spmd)
        for role in roles:
            assert_same_training(local_executor.models[role], transport.pull_state(role), before[role], steps=steps)
        return transport.weights_report("policy")


def test_grpo_on_two_fsdp_ranks_matches_local_with_and_without_micro_batches():
    world, prompts = attrs.evolve(_world(), fsdp_unit_params=0), tiny_prompts(4)  # every decoder layer its own unit
    plain, micro = _compile("grpo", n=4), _compile("grpo", n=4, micro_batch_size=2)
    local_executor = world.build_local()
    before = state_of(local_executor.models["policy"])
    with SpmdTransport(plain.plan, world, device="cpu") as transport:
        for steps, compiled in enumerate((plain, micro, plain), 1):
            local, spmd = _step_both(compiled, local_executor, transport, world, prompts)
            assert_same_metrics(local, spmd)
            assert_same_training(local_executor.models["policy"], transport.pull_state("policy"), before, steps=steps)
        assert local["policy/grad_norm"] > 0  # the step trained something
        dapo = _compile("dapo", n=4, max_rounds=3, overlong_buffer=2)  # the same groups: one transport runs both programs
        more = iter([tiny_prompts(4, 4 * k) for k in range(1, 10)])
        local = PlanRunner(dapo, local_executor).run(prompts, more_prompts=lambda: next(more))[1]
        more = iter([tiny_prompts(4, 4 * k) for k in range(1, 10)])
        spmd = PlanRunner(dapo, transport, controller=world.controller()).run(prompts, more_prompts=lambda: next(more))[1]
        assert_same_metrics(local, spmd)  # the refill loop re-ran worker stages on fresh prompts alike
        reports = transport.weights_report("policy")
        for report in reports.values():  # between steps each rank holds only its FSDP2 shards
            assert report["local_numel"] < 0.6 * report["global_numel"]
        assert sum(r["local_numel"] for r in reports.values()) == reports[0]["global_numel"]


def test_gradients_reduced_once_per_step_on_two_fsdp_ranks_match_local():
    # grad_sync="last": FSDP2 accumulates the first micro-batches' gradients unsharded on each rank and
    # reduce-scatters their sum once; the sum is the same, so local's training is matched as before.
    world = attrs.evolve(_world(), fsdp_unit_params=0)
    compiled = _compile("grpo", placement=rg.colocated(offload=False, checkpointing=False, grad_sync="last"), n=4,
                        micro_batch_size=2)
    assert str(compiled.plan.group("policy").train) == "fsdp2 shard=2 grad-sync=last-micro"
    _matches_local(compiled, world, tiny_prompts(4))


def test_grpo_with_cpu_offload_on_two_fsdp_ranks_matches_local():
    # FSDP2's CPUOffloadPolicy runs on gloo: shards, gradients and AdamW state in host memory, the step on
    # the CPU. On a CPU device its copies to "the device" move nothing, but the offloading path is the one taken.
    world = attrs.evolve(_world(policy=RoleSpec(optimizer="adamw", lr=1e-4)), fsdp_unit_params=0)
    compiled = _compile("grpo", placement=rg.colocated(checkpointing=False, cpu_offload=True), n=4)
    assert str(compiled.plan.group("policy").train) == "fsdp2 shard=2 cpu_offload"
    assert any(isinstance(step, Offload) for step in compiled.plan.steps)  # offload/onload steps run too (recorded on CPU)
    local_executor, prompts = world.build_local(), tiny_prompts(4)
    before = state_of(local_executor.models["policy"])
    with SpmdTransport(compiled.plan, world, device="cpu") as transport:
        for _ in range(2):  # the second step uses the AdamW moments the first left in host memory
            local, spmd = _step_both(compiled, local_executor, transport, world, prompts)
            assert_same_metrics(local, spmd)
        trained = transport.pull_state("policy")
        assert_same_training(local_executor.models["policy"], trained, before, steps=2)
    assert max(float((trained[name] - value).abs().max()) for name, value in before.items()) > 1e-4  # 2 AdamW steps of lr 1e-4
    assert local["policy/grad_norm"] > 0


def test_sync_weights_fills_the_engines_with_the_gathered_fsdp2_weights_bucket_by_bucket():
    world, prompts = _world(), tiny_prompts(4)
    compiled = _compile("grpo", n=4)
    with SpmdTransport(compiled.plan, world, device="cpu") as transport:
        runner = PlanRunner(compiled, transport, controller=world.controller())
        runner.run(prompts)  # trains policy@0 -> policy@1; the engines still serve policy@0
        assert {r["served"] for r in transport.weights_report("policy").values()} == {0}
        assert all(r["engine_diff"] > 0 for r in transport.weights_report("policy").values())
        live = ModelRef("policy", 1)
        transport.begin({0: {"model": live}, 1: {"model": live}})
        transport.sync_weights("synced", "model", SyncRoute("policy", (0, 1), (0, 1), buckets=40, bucket_bytes=16 << 10))
        reports = transport.weights_report("policy")
        assert all(r["served"] == 1 and r["engine_diff"] == 0.0 for r in reports.values())


def test_ppo_with_its_critic_on_two_fsdp_ranks_matches_local():
    world = _world(policy=RoleSpec(optimizer="sgd", lr=0.1), critic=RoleSpec(kind="critic", optimizer="sgd", lr=0.1, seed=1))
    checkpointed = rg.colocated(offload=False, checkpointing=True)  # spmd recomputes activations; local keeps them
    compiled, prompts = _compile("ppo", placement=checkpointed, n=2), tiny_prompts(4)
    assert all(group.train.checkpointing for group in compiled.plan.groups)
    _matches_local(compiled, world, prompts, roles=("policy", "critic"))


def test_split_placement_trains_on_rank_0_and_generates_on_rank_1_like_local(tmp_path):
    build_causal_lm(tokenizer=load_tokenizer(), seed=3).save_pretrained(tmp_path)  # a Hugging Face model directory
    world, prompts = _world(policy=RoleSpec(source=str(tmp_path), optimizer="sgd", lr=0.1)), tiny_prompts(4)
    compiled = _compile("grpo", placement=rg.split({"policy": 1, "rollout": 1}), n=4)
    assert any(t.kind == "send_recv" for t in compiled.plan.transfers())
    reports = _matches_local(compiled, world, prompts)
    assert reports[0]["local_numel"] == reports[0]["global_numel"] and reports[1]["served"] == 1


def test_a_batch_that_does_not_split_evenly_is_refused_before_any_work():
    world = _world()
    compiled = _compile("grpo", n=4)
    runner = PlanRunner(compiled, world.build_local())
    with pytest.raises(PlanInputError, match=r"3 rows.*'policy'.*2 data-parallel ranks.*divisible by 2"):
        runner.run(tiny_prompts(3))


def failure_when_rank_1_dies_mid_step(start_transport, kill) -> str:
    """Run a GRPO step whose reward function (on the controller, mid-step) kills rank 1 with
    `kill(transport)`; returns the error the controller raised, within the transport's timeout."""
    compiled, box = _compile("grpo", n=4), []

    def reward_that_kills_rank_1(completions, **_):
        kill(box[0])
        return length_parity_reward(completions)

    world = WorldSpec({"policy": RoleSpec(optimizer="sgd", lr=0.1)}, {"reward": reward_that_kills_rank_1},
                      max_new_tokens=TOKENS)
    with start_transport(compiled.plan, world, device="cpu", timeout_s=30) as transport:
        box.append(transport)
        runner = PlanRunner(compiled, transport, controller=world.controller())
        start = time.monotonic()
        with pytest.raises(PlanStepError) as caught:
            runner.run(tiny_prompts(4))
        assert time.monotonic() - start < 30  # the death is seen at once, not after the step timeout
    return str(caught.value)


def test_a_worker_killed_mid_step_is_reported_with_the_step_and_the_rank():
    message = failure_when_rank_1_dies_mid_step(SpmdTransport, lambda t: os.kill(t.processes[1].pid, signal.SIGKILL))
    assert "rank 1" in message and "SIGKILL" in message and "role 'policy'" in message
    assert "plan step [" in message


RANK_ONLY_FAILURE = """
import multiprocessing

if multiprocessing.current_process().name.startswith("rlgraph-rank"):  # a spmd rank, not the controller
    import a_module_only_the_controller_has  # noqa: F401


class Echo:
    pass
"""


def test_an_environment_file_that_cannot_load_on_a_rank_is_named_with_the_rank(tmp_path):
    # issue 32: a raw unpickling traceback and "rank 1 died during start" before; the file is loaded on
    # the rank from its path before the recipe is rebuilt, and what fails there comes back as data.
    from rlgraph.runtime.errors import WorkerFailure
    from rlgraph.user_files import import_file

    path = tmp_path / "elsewhere" / "rank_env.py"
    path.parent.mkdir()
    path.write_text(RANK_ONLY_FAILURE)
    world = attrs.evolve(_world(), envs={"env": import_file(path).Echo})
    with pytest.raises(WorkerFailure, match=rf"rank 0 raised UserFileError during start: rank 0 cannot load {path}"
                                            r".*No module named 'a_module_only_the_controller_has'"):
        SpmdTransport(rg.compile(ALGORITHMS["grpo"], mesh="cpu:1", placement=COLOCATED, sizes={"B": 4, "P": 8, "T": TOKENS},
                                 max_new_tokens=TOKENS).plan, world, device="cpu")  # one rank: the start is the cost


class WorldThatRecordsItsEnvironment(WorldSpec):
    """Each rank writes the variables it sees as it builds its roles."""

    def build(self, rank, plan, device):
        record = {name: os.environ.get(name) for name in ("RLGRAPH_PROBE", "TRITON_INTERPRET")}
        (Path(os.environ["RLGRAPH_PROBE_DIR"]) / f"{record['RLGRAPH_PROBE']}-{rank}.json").write_text(json.dumps(record))
        return super().build(rank, plan, device)


def test_every_pool_s_workers_see_the_controller_s_environment_as_the_pool_starts(tmp_path, monkeypatch):
    """The workers fork from one server per controller, started with its first pool, yet each pool's
    ranks see the controller's variables as they are when that pool starts, as spawned ones would; and
    the worker's entry module imports neither Triton nor rlgraph's kernels, which read TRITON_INTERPRET
    as they are defined, before the worker takes the controller's variables."""
    monkeypatch.setenv("RLGRAPH_PROBE_DIR", str(tmp_path))
    plan = _compile("grpo").plan
    for probe, interpret in (("first", "0"), ("second", "1")):
        monkeypatch.setenv("RLGRAPH_PROBE", probe)
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
        with SpmdTransport(plan, WorldThatRecordsItsEnvironment(
                {"policy": RoleSpec(optimizer="sgd", lr=0.1)}, {"reward": length_parity_reward}, max_new_tokens=TOKENS), device="cpu"):
            pass
    for probe, interpret in (("first", "0"), ("second", "1")):
        for rank in (0, 1):
            assert json.loads((tmp_path / f"{probe}-{rank}.json").read_text()) == {
                "RLGRAPH_PROBE": probe, "TRITON_INTERPRET": interpret}
    imported = subprocess.run([sys.executable, "-c", "import sys, rlgraph.runtime.spmd; print(sorted(m for m in sys.modules "
                               "if m.split('.')[0] == 'triton' or m.startswith('rlgraph.kernels')))"],
                              capture_output=True, text=True, timeout=120)
    assert imported.stdout.strip() == "[]", imported.stderr[-2000:]


@pytest.mark.parametrize("form", ["parts", "full"])
def test_a_spmd_checkpoint_resumes_exactly_on_spmd_and_on_local(tmp_path, form):
    # "parts": each rank writes its own rows (what `rlgraph train` does on spmd/Ray); "full": the whole
    # state gathered to the controller first. Both resume exactly on spmd and load on one process.
    from rlgraph.train.checkpoint import load_checkpoint, read_checkpoint, save_checkpoint

    lr = 1e-3
    world = _world(policy=RoleSpec(optimizer="adamw", lr=lr))  # Adam moments: the sharded state must round-trip
    compiled = _compile("grpo", n=4)
    first, second = tiny_prompts(4), tiny_prompts(4, 4)
    with SpmdTransport(compiled.plan, world, device="cpu") as transport:
        runner = PlanRunner(compiled, transport, controller=world.controller())
        runner.run(first)
        sent, all_ranks = [], transport._all
        transport._all = lambda ranks, command, *args, **kw: (sent.append(command), all_ranks(ranks, command, *args, **kw))[1]
        path = save_checkpoint(tmp_path, 1, runner if form == "parts" else runner.export_state(), {})
        transport._all = all_ranks
        if form == "parts":  # nothing gathered: no rank built the full state, nothing but numbers came back
            assert sent == ["write_parts"]
            assert sorted(file.name for file in path.glob("policy.*")) == [
                "policy.optim.part-0-of-2.pt", "policy.optim.part-1-of-2.pt",
                "policy.part-0-of-2.safetensors", "policy.part-1-of-2.safetensors"]
            whole, gathered = read_checkpoint(path)[0].roles["policy"], runner.export_state().roles["policy"]
            assert whole.model.keys() == gathered.model.keys()
            assert all(torch.equal(whole.model[name], gathered.model[name]) for name in gathered.model)
            moments = [(whole.optimizer["state"][i][key], gathered.optimizer["state"][i][key])
                       for i in gathered.optimizer["state"] for key in ("exp_avg", "exp_avg_sq")]
            assert all(torch.equal(a, b) for a, b in moments)
        uninterrupted = runner.run(second)[1]
        final = transport.pull_state("policy")
    assert_spmd_resume_is_exact(compiled, world, path, second, uninterrupted, final)  # the same runtime: exact
    local_executor = world.build_local()
    local = PlanRunner(compiled, local_executor)
    load_checkpoint(path, local)  # resumed on one process: the same step, up to float rounding
    resumed_from = state_of(local_executor.models["policy"])
    assert_same_metrics(uninterrupted, local.run(second)[1])
    assert_same_training(local_executor.models["policy"], final, resumed_from, steps=1)


def test_hsdp_two_replicas_of_two_shards_match_local():
    world, prompts = _world(), tiny_prompts(4)
    compiled = rg.compile(ALGORITHMS["grpo"], mesh="cpu:4", placement=rg.colocated(fsdp=2, offload=False, checkpointing=False),
                          sizes={"B": 4, "P": 8, "T": TOKENS}, max_new_tokens=TOKENS, n=4)
    assert "fsdp2 shard=2 replicate=2" in compiled.as_text()
    reports = _matches_local(compiled, world, prompts)
    assert reports[0]["local_numel"] == reports[2]["local_numel"] < 0.6 * reports[0]["global_numel"]
    assert all(report["engine_diff"] is not None for report in reports.values())


def test_workers_decode_compiled_with_generation_compile_on_and_sample_the_eager_tokens(tmp_path, monkeypatch):
    """`WorldSpec(decode_compile="on")` (what `world_of_config` passes for `generation.compile: on`)
    reaches the ranks' executors: each rank compiles its decode step (its measured compile lands in
    the Inductor cache directory's records, which the workers inherit) and samples the same
    completions as eager ranks, at temperature 1 (the noise is counter-based, so only a logit
    rounded across a Gumbel tie could differ; none does here)."""
    from rlgraph.backends.local.decode_compile import read_records

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    completions: dict[str, list[str]] = {}

    def recording(mode: str):
        def reward(texts: list[str], **meta) -> list[float]:  # scored on the controller: this process
            completions.setdefault(mode, []).extend(texts)
            return length_parity_reward(texts, **meta)
        return reward

    tokens = 2  # k = 2 decode steps a compiled chunk: the smallest graphs that still chunk, so the least compile time
    compiled = rg.compile(ALGORITHMS["grpo"], mesh="cpu:2", placement=COLOCATED, sizes={"B": 4, "P": 8, "T": tokens},
                          max_new_tokens=tokens, n=2)
    prompts = tiny_prompts(4)
    for mode in ("off", "on"):
        world = attrs.evolve(_world(), rewards={"reward": recording(mode)}, decode_compile=mode, max_new_tokens=tokens)
        # the ranks compile the prefill and a decode chunk cold during the step: a minute or more in a loaded
        # `make test`, past the CPU step timeout (60 s), so this test allows more
        with SpmdTransport(compiled.plan, world, device="cpu", timeout_s=600) as transport:
            PlanRunner(compiled, transport, controller=world.controller()).run(prompts)
    assert completions["on"] == completions["off"] and len(completions["on"]) == 8
    # both ranks compiled one shape: 4 rows each, a cache of 16 (the prompt width padded, `padded_width`) + 2 columns,
    # decoded in one chunk of 2 steps
    assert [len(seconds) for key, seconds in read_records().items() if key.endswith("|cpu|4x18x2")] == [2], read_records()
