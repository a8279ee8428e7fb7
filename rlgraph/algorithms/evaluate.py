"""Evaluation is an algorithm too: greedy decoding, scored by the reward role, nothing updated."""

import rlgraph as rg


@rg.algorithm
def evaluate(state: rg.State, prompts: rg.Prompts, *, max_new_tokens=None, stop=()):
    ro = rg.generate(state.policy, prompts, n=1, temperature=0.0, max_new_tokens=max_new_tokens, stop=stop)  # Rollouts[B, T]
    r = rg.score(state.reward, ro)                                                                # [B]
    return state, {"accuracy": r.mean(), "response_tokens": ro.mask.sum(-1).float().mean()}
