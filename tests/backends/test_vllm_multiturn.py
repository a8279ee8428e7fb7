"""Multi-turn episodes on vLLM (`rlgraph/backends/vllm/multiturn.py`): its pure helpers everywhere, and live
on the session's engine in .venv-vllm (`make test`): token in / token out, the prefix cache hit across
turns, greedy episodes equal to the native engine's, a compiled agent GRPO step."""

import copy
import importlib.util

import pytest
import torch

import rlgraph as rg
from rlgraph.backends.local.state import LMWorker
from rlgraph.backends.local.executor import LocalExecutor, RewardWorker
from rlgraph.backends.protocols import EnvRef
from rlgraph.backends.vllm.multiturn import cut_at_stop, turn_seeds
from rlgraph.testing import tiny_prompts
from rlgraph.testing.tiny import length_parity_reward
from tests.backends.conftest import BLOCK_TOKENS, sync

live = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                          reason="vLLM is not installed here: `make test` runs this module in .venv-vllm")

TURNS = dict(max_turns=2, max_tokens_per_turn=4, max_total_tokens=44)


class Digits(rg.Env):
    """A 30-digit first observation, so a row's first context (prompt + it) fills a whole cache block;
    then two turns, the first answered "12"."""

    def reset(self, row):
        self.turn = 0
        return "0123456789" * 3

    def step(self, text):
        self.turn += 1
        return rg.Step("12", reward=float(len(text)), done=self.turn >= 2, info={"tool_calls": 1})


def test_a_turn_is_cut_after_the_first_stop_and_kept_whole_without_one():
    ends = lambda ids: ids[-2:] == [7, 8]  # noqa: E731 - a two-token stop string
    assert cut_at_stop([5, 7, 8, 9, 7, 8], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6], ends) == ([5, 7, 8], [0.1, 0.2, 0.3])
    assert cut_at_stop([5, 7, 9], [0.1, 0.2, 0.3], ends) == ([5, 7, 9], [0.1, 0.2, 0.3])
    assert cut_at_stop([], [], ends) == ([], [])


def test_turn_seeds_differ_per_turn_and_do_not_depend_on_the_shard():
    index = torch.tensor([3, 7])
    whole = turn_seeds(0, 1, index, 2, turn=1)
    assert whole == turn_seeds(0, 1, index[:1], 2, turn=1) + turn_seeds(0, 1, index[1:], 2, turn=1)
    assert len(set(whole)) == 4 and set(whole).isdisjoint(turn_seeds(0, 1, index, 2, turn=0))
    assert all(0 <= seed < 2**63 for seed in whole)


def _executors(vllm_live, env=Digits):
    from rlgraph.backends.vllm.local import VLLMLocalExecutor

    engine, model, tokenizer = vllm_live
    common = dict(max_new_tokens=TURNS["max_total_tokens"], envs={"env": env})
    native = LocalExecutor({"policy": LMWorker(model)}, {}, tokenizer, **common)
    return native, VLLMLocalExecutor({"policy": LMWorker(model)}, {}, tokenizer, engine=engine, **common)


@live
def test_the_ids_trained_on_are_the_ids_sampled_and_the_prefix_cache_serves_the_earlier_turns(vllm_live, monkeypatch):
    from rlgraph.backends.local.logprobs import sequence_logprobs

    engine, model, _ = vllm_live
    _, ours = _executors(vllm_live)
    calls = []
    real = engine.continue_rows

    def spy(contexts, caps, seeds, params, version):
        answers = real(contexts, caps, seeds, params, version)
        calls.append(([list(context) for context in contexts], answers))
        return answers

    monkeypatch.setattr(engine, "continue_rows", spy)
    prompts = tiny_prompts(2)
    ro, episodes, _ = ours.rollout(ours.current("policy"), EnvRef("env"), prompts, n=2, **TURNS)
    assert len(calls) == 2 and all(len(answers) == len(ro) for _, answers in calls)  # every row plays both turns
    for row in range(len(ro)):
        sampled = [token for _, answers in calls for token in answers[row][0]]
        assert ro.response_ids[row][ro.mask[row]].tolist() == sampled  # the policy's ids, as the engine sampled them
        prompt = prompts.ids[row // 2][prompts.mask[row // 2]].tolist()
        second = calls[1][0][row]  # turn 2's request: the prompt, then the response so far, as ids
        assert second == prompt + ro.response_ids[row][:len(second) - len(prompt)].tolist()
        assert bool(ro.context_mask[row][:len(second) - len(prompt)].all())
    assert episodes[:, rg.EPISODE_FIELDS.index("turns")].tolist() == [2.0] * len(ro)
    with torch.no_grad():
        trainer = sequence_logprobs(model, ro)  # [N, T], attending to context_mask
    # fp32 both sides: the rounding bound of test_vllm_live.py
    assert float((trainer - ro.logprobs).abs()[ro.mask].max()) < 3e-3 and bool((ro.logprobs[~ro.mask] == 0).all())
    # turn 1 computed each row's first block (prompt + the 30-digit observation >= 32 tokens); turn 2 finds it
    sent, cached = engine.turn_cache[1]
    assert cached >= BLOCK_TOKENS * len(ro) and sent > cached


@live
def test_greedy_episodes_on_vllm_equal_the_native_engines(vllm_live):
    native, ours = _executors(vllm_live)
    prompts = tiny_prompts(3)
    theirs = native.rollout(native.current("policy"), EnvRef("env"), prompts, n=1, temperature=0.0, **TURNS)
    mine = ours.rollout(ours.current("policy"), EnvRef("env"), prompts, n=1, temperature=0.0, **TURNS)
    for name in ("response_ids", "mask", "context_mask"):
        assert torch.equal(getattr(mine[0], name), getattr(theirs[0], name)), name
    timed = rg.EPISODE_FIELDS.index("env_seconds")  # wall-clock: the one statistic that may differ
    same = [k for k in range(len(rg.EPISODE_FIELDS)) if k != timed]
    assert torch.equal(mine[1][:, same], theirs[1][:, same]) and torch.equal(mine[2], theirs[2])


@live
def test_a_compiled_agent_grpo_step_runs_its_episodes_on_vllm(vllm_live):
    from rlgraph.algorithms import agent_grpo
    from rlgraph.backends.vllm.local import VLLMLocalExecutor
    from rlgraph.runtime.plan_runner import PlanRunner

    engine, model, tokenizer = vllm_live
    policy = copy.deepcopy(model).train()
    executor = VLLMLocalExecutor({"policy": LMWorker(policy, torch.optim.SGD(policy.parameters(), lr=0.1))},
                                 {"reward": RewardWorker(length_parity_reward)}, tokenizer, engine=engine,
                                 max_new_tokens=TURNS["max_total_tokens"], envs={"env": Digits})
    compiled = rg.compile(agent_grpo, mesh="cpu:1", placement=rg.colocated(offload=False), engine="vllm",
                          sizes={"B": 2, "P": 8, "T": TURNS["max_total_tokens"]}, n=2, **TURNS)
    assert "vLLM, whose prefix cache holds the earlier turns" in compiled.as_text()
    try:
        _, metrics = PlanRunner(compiled, executor).run(tiny_prompts(2))
        assert executor.syncs[-1][0] == 0 and executor.current("policy").version == 1
        assert metrics["env/turns"] == pytest.approx(2.0)
    finally:
        sync(engine, model, 0)  # the session's engine back at version 0
