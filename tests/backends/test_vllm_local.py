"""The local runtime generating on a live vLLM engine (`VLLMLocalExecutor`): a compiled GRPO plan
syncs the trained policy into the engine in buckets, generates on it, and trains on its rollouts.
Runs in `.venv-vllm` (`make test`), sharing the session's engine (tests/backends/conftest.py)."""

import copy
import importlib.util

import attrs

import pytest
import torch

import rlgraph as rg
from rlgraph.algorithms import ALGORITHMS
from rlgraph.backends.local.state import LMWorker
from rlgraph.backends.local.executor import RewardWorker, StaleVersionError
from rlgraph.backends.local.counter_sampling import SamplingParams
from rlgraph.backends.protocols import ModelRef
from rlgraph.runtime.plan_runner import PlanRunner
from rlgraph.runtime.transport import SyncRoute
from rlgraph.testing import tiny_prompts
from rlgraph.testing.tiny import length_parity_reward
from tests.backends.conftest import randomise_adapters, sync

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed here: `make test` runs this module in .venv-vllm")

SIZES = {"B": 4, "P": 8, "T": 4}


def test_weight_buckets_follow_the_byte_budget_and_keep_every_parameter_once(vllm_live):
    from rlgraph.backends.vllm.local import weight_buckets

    _, model, _ = vllm_live
    named = list(model.named_parameters())
    for budget in (1, 64 << 10, 1 << 30):
        parts = list(weight_buckets(model, budget))
        assert [name for part in parts for name, _ in part] == [name for name, _ in named]
        assert all(len(part) == 1 or sum(t.numel() * 4 for _, t in part) <= budget for part in parts)
    assert len(list(weight_buckets(model, 1 << 30))) == 1 and len(list(weight_buckets(model, 1))) == len(named)


def test_a_compiled_grpo_step_syncs_generates_on_vllm_and_reports_the_logprob_mismatch(vllm_live):
    from rlgraph.backends.vllm.local import VLLMLocalExecutor, weight_buckets

    engine, model, tokenizer = vllm_live
    policy = copy.deepcopy(model).train()
    executor = VLLMLocalExecutor({"policy": LMWorker(policy, torch.optim.SGD(policy.parameters(), lr=0.1))},
                                 {"reward": RewardWorker(length_parity_reward)}, tokenizer, engine=engine,
                                 max_new_tokens=SIZES["T"])
    compiled = rg.compile(ALGORITHMS["grpo"], mesh="cpu:1", placement=rg.colocated(offload=False), sizes=SIZES,
                          n=2, max_new_tokens=SIZES["T"], engine="vllm", tis_cap=2.0)
    plan = compiled.as_text()
    assert "policy[vllm tp=1 dp=1]" in plan and "vllm on cpu: no sleep mode" in plan
    assert "in 1 bucket(s)" in plan
    try:
        _, metrics = PlanRunner(compiled, executor).run(tiny_prompts(4))
        assert executor.syncs[-1][:2] == (0, 1) and engine.version == 0  # the plan's sync, in its one bucket
        # fp32 on both sides: the mismatch is rounding only (the bound of test_vllm_live.py)
        assert 0.0 <= metrics["logprob_mismatch/max"] < 3e-3
        assert executor.current("policy").version == 1
        with pytest.raises(StaleVersionError, match="policy@1 but rank 0's vLLM engine serves policy@0"):
            executor.generate(ModelRef("policy", 1), tiny_prompts(2))
        executor.sync_weights(ModelRef("policy", 1), SyncRoute("policy", (0,), (0,), buckets=8, bucket_bytes=64 << 10))
        assert executor.syncs[-1][:2] == (1, len(list(weight_buckets(policy, 64 << 10)))) and engine.version == 1
        assert executor.syncs[-1][1] > 1
        assert executor.generate(ModelRef("policy", 1), tiny_prompts(2)).response_ids.shape == (2, 4)
    finally:
        sync(engine, model, 0)  # the session's engine back at version 0


def test_vllm_with_offload_on_a_cpu_mesh_is_refused_before_anything_runs():
    from rlgraph.passes.options import PlacementConfigError

    with pytest.raises(PlacementConfigError, match="(?s)vLLM has no sleep mode on CPU.*colocated:offload=False"):
        rg.compile(ALGORITHMS["grpo"], mesh="cpu:1", placement=rg.colocated(offload=True), sizes=SIZES, n=2,
                   engine="vllm")


# -- faults: each stops the run with the plan step, the rank and the fix; nothing is left inside the engine ----

def _grpo_executor(engine, policy, tokenizer):
    from rlgraph.backends.vllm.local import VLLMLocalExecutor

    return VLLMLocalExecutor({"policy": LMWorker(policy, torch.optim.SGD(policy.parameters(), lr=0.1))},
                             {"reward": RewardWorker(length_parity_reward)}, tokenizer, engine=engine,
                             max_new_tokens=SIZES["T"])


def _grpo(bucket_bytes=None):
    from rlgraph.passes import compile_program

    compiled = rg.compile(ALGORITHMS["grpo"], mesh="cpu:1", placement=rg.colocated(offload=False), sizes=SIZES, n=2,
                          max_new_tokens=SIZES["T"], engine="vllm")
    if bucket_bytes is None:
        return compiled
    options = attrs.evolve(compiled.options, bucket_bytes=bucket_bytes)  # a CompileOptions field rg.compile leaves default
    return compile_program(ALGORITHMS["grpo"].trace(n=2, max_new_tokens=SIZES["T"]), options)


def test_an_engine_core_that_dies_mid_generate_stops_the_step_and_is_not_used_again(vllm_live, monkeypatch):
    from vllm.v1.engine.exceptions import EngineDeadError

    from rlgraph.backends.vllm.engine import VLLMError
    from rlgraph.runtime.errors import PlanStepError

    engine, model, tokenizer = vllm_live
    executor, core = _grpo_executor(engine, copy.deepcopy(model).train(), tokenizer), engine.llm.llm_engine

    def dies():
        raise EngineDeadError()

    monkeypatch.setattr(core, "step", dies)  # the engine core's loop fails after the requests went in
    try:
        with pytest.raises(PlanStepError, match=r"(?s)plan step \[\d+\] failed on rank 0 \(role 'policy'\):\n\s+\[\d+\] "
                                                r"generate .*rank 0's vLLM engine for 'policy' failed during generate: "
                                                r"EngineDeadError: .*fix: .*rlgraph train --resume RUN_DIR"):
            PlanRunner(_grpo(), executor).run(tiny_prompts(4))
        with pytest.raises(VLLMError, match=r"failed earlier \(EngineDeadError"):
            executor.sync_weights(ModelRef("policy", 0))  # a dead engine takes no weights either
    finally:
        monkeypatch.undo()
        while core.has_unfinished_requests():  # what the failed call left inside the session's engine
            core.step()
        engine.failed = None
        sync(engine, model, 0)


def test_a_sync_that_fails_in_its_last_bucket_names_the_sync_step_and_leaves_no_version(vllm_live, monkeypatch):
    from rlgraph.runtime.errors import PlanStepError

    engine, model, tokenizer = vllm_live
    policy = copy.deepcopy(model).train()
    policy.model.norm.weight = torch.nn.Parameter(torch.ones(policy.config.hidden_size - 1))  # the last layer's
    loads, real = [], engine.load_weights
    monkeypatch.setattr(engine, "load_weights", lambda bucket: (loads.append(len(bucket)), real(bucket))[1])
    compiled = _grpo(bucket_bytes=64 << 10)
    assert "in 1 bucket(s)" not in compiled.as_text()
    try:
        with pytest.raises(PlanStepError, match=r"(?s)plan step \[0\] failed on rank 0 \(role 'policy'\):\n\s+\[0\] "
                                                r"sync_weights .*failed to load a weight bucket of 'policy'.*fix: send "
                                                r"the Hugging Face names and shapes"):
            PlanRunner(compiled, _grpo_executor(engine, policy, tokenizer)).run(tiny_prompts(4))
        assert len(loads) > 1  # buckets before the bad one were loaded: it failed in the middle of the sync
        assert engine.version is None and not engine.loading
        with pytest.raises(StaleVersionError, match="no complete policy weights"):
            engine.generate(tiny_prompts(2), 1, SamplingParams(max_new_tokens=2), seed=0, call=0,
                            model=ModelRef("policy", 0))
    finally:
        monkeypatch.undo()
        sync(engine, model, 0)


# -- LoRA: the adapters alone, through vLLM's LoRA support ------------------------------------------

def _greedy(executor, version, prompts):
    return executor.generate(ModelRef("policy", version), prompts, temperature=0.0, max_new_tokens=6).response_ids


def test_a_lora_policy_syncs_its_adapters_alone_and_greedy_tokens_equal_the_native_engines(lora_live):
    import os

    from rlgraph.backends.local.executor import LocalExecutor
    from rlgraph.backends.vllm.local import VLLMLocalExecutor

    engine, policy, tokenizer = lora_live
    worker = LMWorker(policy)
    ours = VLLMLocalExecutor({"policy": worker}, {}, tokenizer, engine=engine, max_new_tokens=6)
    native = LocalExecutor({"policy": worker}, {}, tokenizer, max_new_tokens=6)
    prompts = tiny_prompts(6)
    ours.sync_weights(ModelRef("policy", 0))
    assert ours.syncs[-1][:2] == (0, 1) and sorted(os.listdir(ours.adapter_dir)) == ["v0"]
    files = sorted(os.listdir(os.path.join(ours.adapter_dir, "v0")))
    assert "adapter_model.safetensors" in files and "model.safetensors" not in files  # the adapters alone
    assert torch.equal(_greedy(ours, 0, prompts), _greedy(native, 0, prompts))
    with policy.disable_adapter():  # the adapters matter: the base alone generates otherwise
        assert not torch.equal(_greedy(native, 0, prompts), _greedy(ours, 0, prompts))
    randomise_adapters(policy, seed=1)  # what an update does, then the version it makes
    worker.version = 1
    ours.sync_weights(ModelRef("policy", 1))
    assert sorted(os.listdir(ours.adapter_dir)) == ["v1"] and engine.version == 1  # v0's folder removed
    with pytest.raises(StaleVersionError, match="policy@0 but rank 0's vLLM engine serves policy@1"):
        engine.generate(prompts, 1, SamplingParams(temperature=0.0, max_new_tokens=2), seed=0, call=0,
                        model=ModelRef("policy", 0))
    assert torch.equal(_greedy(ours, 1, prompts), _greedy(native, 1, prompts))

def _staleness_run(vllm_live, staleness, lr):
    """Three GRPO calls on the session's engine; (metrics per call, the versions the engine was synced to,
    the policy's live version, the version the engine serves at the end)."""
    from rlgraph.backends.vllm.local import VLLMLocalExecutor

    engine, model, tokenizer = vllm_live
    policy = copy.deepcopy(model).train()
    executor = VLLMLocalExecutor({"policy": LMWorker(policy, torch.optim.SGD(policy.parameters(), lr=lr))},
                                 {"reward": RewardWorker(length_parity_reward)}, tokenizer, engine=engine,
                                 max_new_tokens=SIZES["T"])
    options = {"staleness": staleness} if staleness else {}
    compiled = rg.compile(ALGORITHMS["grpo"], mesh="cpu:1", placement=rg.colocated(offload=False), sizes=SIZES, n=2,
                          max_new_tokens=SIZES["T"], engine="vllm", **options)
    drawn = [0]

    def more():  # batch i is prompts 4i..4i+3, whoever draws it
        drawn[0] += 1
        return tiny_prompts(4, offset=4 * drawn[0])

    runner = PlanRunner(compiled, executor)
    try:
        metrics = [runner.run(tiny_prompts(4) if step == 0 else more(), more_prompts=more)[1] for step in range(3)]
        return metrics, [version for version, _, _ in executor.syncs], executor.current("policy").version, engine.version
    finally:
        sync(engine, model, 0)


def test_with_staleness_1_the_engine_generates_each_batch_with_the_version_the_lag_bound_allows(vllm_live):
    """Batch i is generated by policy@max(0, i-1) and trained by policy@i (docs/async.md). The engine
    holds one version: the rollout lane's sync_weights step loads policy@i before batch i+1 is generated,
    and the engine refuses any other version, so the syncs it received are the versions it generated with."""
    metrics, synced, live, served = _staleness_run(vllm_live, 1, lr=0.1)
    assert [m["rollout/staleness"] for m in metrics] == [0.0, 1.0, 1.0]
    assert synced[-2:] == [1, 2] and set(synced[:-2]) == {0}  # batches 0 and 1 from policy@0, then 2 from @1, 3 from @2
    assert live == 3 and served == 2  # three updates; batch 3, in flight, came from policy@2
    # with frozen weights every version is the same model, so the schedule alone must not change a number
    (frozen, _, _, _), (synchronous, _, _, _) = _staleness_run(vllm_live, 1, lr=0.0), _staleness_run(vllm_live, 0, lr=0.0)
    assert [{k: v for k, v in m.items() if k != "rollout/staleness"} for m in frozen] == synchronous
