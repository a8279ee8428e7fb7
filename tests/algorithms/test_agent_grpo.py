"""Agent GRPO (`rlgraph/algorithms/agent_grpo.py`): multi-turn rollouts through the whole stack."""

import math

import pytest
import torch

import rlgraph as rg
from rlgraph.algorithms import agent_grpo
from rlgraph.backends.protocols import ModelRef
from rlgraph.runtime.eager import Interpreter
from rlgraph.runtime.plan_runner import PlanRunner
from rlgraph.testing import tiny_executor, tiny_prompts
from tests.helpers import assert_same_metrics, params_of


class CountOnes:
    """Two turns; the reward is how many '1's the policy wrote in all (varies on an untrained model)."""

    def reset(self, row):
        self.turn, self.ones = 0, 0

    def step(self, text):
        self.turn += 1
        self.ones += text.count("1")
        done = self.turn >= 2
        return rg.Step("" if done else "7+7", float(self.ones) if done else 0.0, done, {"tool_calls": 1})


HPARAMS = dict(n=4, max_turns=2, max_tokens_per_turn=6, max_total_tokens=20)


def executor():
    ex = tiny_executor(lr=0.1)
    ex.envs["env"] = CountOnes
    return ex


def test_two_steps_train_on_the_policy_tokens_and_report_the_episodes():
    ex, program = executor(), agent_grpo.trace(**HPARAMS)
    before = params_of(ex)
    for step in range(2):
        state, metrics = Interpreter(ex).run(program, tiny_prompts(2, offset=2 * step))
        assert state["policy"] == ModelRef("policy", step + 1)
    assert metrics["env/turns"] == 2.0 and metrics["env/tool_calls"] == 2.0
    assert metrics["env/observation_tokens"] > 0 and metrics["time/env_s_per_step"] >= 0
    assert math.isfinite(metrics["policy/loss"]) and metrics["policy/grad_norm"] > 0
    assert metrics["policy/logprob_diff"] < 1e-4  # trainer and sampler agree on every policy token, across turns
    assert any(not torch.equal(a, b) for a, b in zip(before, params_of(ex)))


def test_the_compiled_plan_runs_what_the_interpreter_runs():
    compiled = rg.compile(agent_grpo, sizes={"B": 2, "P": 8, "T": 20}, **HPARAMS)
    eager = Interpreter(executor()).run(agent_grpo.trace(**HPARAMS), tiny_prompts(2))[1]
    planned = PlanRunner(compiled, executor()).run(tiny_prompts(2))[1]
    assert_same_metrics(eager, planned)


def test_the_plan_shows_the_rollout_stage_and_its_env_calls():
    text = rg.compile(agent_grpo, sizes={"B": 2, "P": 8, "T": 20}, **HPARAMS, step_timeout=5).as_text()
    assert ("8 episodes (2 prompts x n=4), <= 2 turns x <= 6 tokens, <= 20 response tokens (policy + observations); "
            "1 replica(s) x tp=1; between turns env 'env'.step per row in the generating rank's process, concurrently, "
            "timeout 5 s; each row continues from its KV cache") in text


@pytest.mark.parametrize("option, values", [("max_turns", [0, -1, "3", 1.5]), ("step_timeout", [0, -2.0, "10"]),
                                            ("max_tokens_per_turn", [0, 2.5]), ("max_total_tokens", [0, "many"])])
def test_rollout_refuses_bad_budgets_at_the_users_line(option, values):
    for value in values:
        @rg.algorithm
        def algo(state: rg.State, prompts: rg.Prompts):
            ro, episodes, _ = rg.rollout(state.policy, state.env, prompts, **{option: value})  # E-rollout
            return state, {"reward": episodes[:, 0].mean()}

        with pytest.raises(rg.TraceError) as error:
            algo.trace()
        assert f"rg.rollout: {option}={value!r} is not valid" in str(error.value) and "# E-rollout" in str(error.value)


def test_rollout_refuses_a_turn_longer_than_the_response_and_a_wrong_env():
    @rg.algorithm
    def too_long(state: rg.State, prompts: rg.Prompts):
        ro, episodes, _ = rg.rollout(state.policy, state.env, prompts, max_tokens_per_turn=64, max_total_tokens=32)
        return state, {"reward": episodes[:, 0].mean()}

    with pytest.raises(rg.TraceError, match="max_tokens_per_turn=64 is more than max_total_tokens=32"):
        too_long.trace()

    @rg.algorithm
    def reward_as_env(state: rg.State, prompts: rg.Prompts):
        ro, episodes, _ = rg.rollout(state.policy, state.reward, prompts)
        return state, {"reward": episodes[:, 0].mean()}

    with pytest.raises(rg.SpecError, match="rg.rollout: the environment must be an environment role such as state.env"):
        reward_as_env.trace()


def test_multi_turn_generation_runs_on_the_native_engine_unless_vllm_is_asked_for():
    auto = rg.compile(agent_grpo, mesh="1x2:h100", sizes={"B": 2, "P": 8, "T": 20}, **HPARAMS)
    assert auto.plan.group("policy").generate.engine == "native"  # auto would pick vLLM for generate
    assert "each row continues from its KV cache" in auto.as_text()
    vllm = rg.compile(agent_grpo, mesh="1x2:h100", engine="vllm", sizes={"B": 2, "P": 8, "T": 20}, **HPARAMS)
    assert vllm.plan.group("policy").generate.engine == "vllm"
    assert "each turn sends the row's context as token ids to vLLM, whose prefix cache holds the earlier turns" \
        in vllm.as_text()
