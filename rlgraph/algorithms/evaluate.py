"""Evaluation is an algorithm too: greedy decoding, scored by the reward role, nothing updated."""

import rlgraph as rg
from rlgraph.algorithms.agent_grpo import transcript_outputs


@rg.algorithm
def evaluate(state: rg.State, prompts: rg.Prompts, *, max_new_tokens=None, stop=()):
    ro = rg.generate(state.policy, prompts, n=1, temperature=0.0, max_new_tokens=max_new_tokens, stop=stop)  # Rollouts[B, T]
    r = rg.score(state.reward, ro)                                                                # [B]
    return state, {"accuracy": r.mean(), "response_tokens": ro.mask.sum(-1).float().mean()}


@rg.algorithm
def evaluate_agent(state: rg.State, prompts: rg.Prompts, *, max_turns=4, max_tokens_per_turn=None, max_total_tokens=None,
                   step_timeout=30.0):
    """Greedy multi-turn episodes with the environment; "accuracy" is the env's mean reward."""
    ro, episodes, turn_rewards = rg.rollout(state.policy, state.env, prompts, n=1, temperature=0.0, max_turns=max_turns,
                                 max_tokens_per_turn=max_tokens_per_turn, max_total_tokens=max_total_tokens,
                                 step_timeout=step_timeout)                  # Rollouts[B, T], [B, E]
    return (state, {"accuracy": episodes[:, 0].mean(), "response_tokens": ro.mask.sum(-1).float().mean(),
                    "turns": episodes[:, 1].mean()}, transcript_outputs(ro, episodes, turn_rewards))
