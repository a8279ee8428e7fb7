"""Multi-turn episodes as readable transcripts, for the run's samples.jsonl (docs/agents.md).

An agent algorithm hands back its rollouts, episode statistics and per-turn rewards as program
outputs (`agent_grpo`, `evaluate_agent`); the plan gathers them to the controller, where
`transcripts` cuts each response into its turns by the masks it carries: the policy's tokens
(`ro.mask`) and the observations (`ro.context_mask` without `ro.mask`), each decoded on its own,
so a reader sees exactly what the policy wrote and what the environment answered:

    {"step": 3, "kind": "train", "prompt": "37*48=", "reward": 1.0, "answer": "1776",
     "turns": [{"role": "policy", "text": "<tool>calculator(37*48)</tool>", "reward": 0.0},
               {"role": "env", "text": "1776"},
               {"role": "policy", "text": "1776", "reward": 1.0}],
     "episode": {"turns": 2.0, "tool_calls": 1.0, ...}}
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rlgraph.batches import Rollouts
from rlgraph.ir.primitives import EPISODE_FIELDS


def transcripts(ro: Rollouts, episodes: torch.Tensor, turn_rewards: torch.Tensor, tokenizer: Any,
                limit: int) -> list[dict[str, Any]]:
    """The first `limit` episodes of `ro` (rows [N,T]) as samples.jsonl rows (module docstring)."""
    texts, answers = ro.meta.get("text"), ro.meta.get("answer")
    rows = []
    for row in range(min(limit, len(ro))):
        stats = dict(zip(EPISODE_FIELDS, episodes[row].tolist()))
        prompt = texts[row] if texts is not None else tokenizer.decode(ro.prompt_ids[row][ro.prompt_mask[row]].tolist())
        rows.append({"prompt": prompt, "reward": stats.pop("reward"),
                     "turns": _turns(ro, turn_rewards, row, tokenizer),
                     **({"answer": answers[row]} if answers is not None else {}), "episode": stats})
    return rows


def _turns(ro: Rollouts, turn_rewards: torch.Tensor, row: int, tokenizer: Any) -> list[dict[str, Any]]:
    """Row `row`'s response cut into runs of the policy's tokens and of observation tokens (two policy
    turns with an empty observation between them read as one)."""
    policy = ro.mask[row].tolist()                                                         # [T]
    real = (ro.context_mask[row] if ro.context_mask is not None else ro.mask[row]).tolist()  # [T]
    ids, rewards = ro.response_ids[row].tolist(), turn_rewards[row].tolist()             # [T], [T]
    turns: list[dict[str, Any]] = []
    for columns, is_policy in _runs(policy, real):
        turn = {"role": "policy" if is_policy else "env", "text": tokenizer.decode([ids[c] for c in columns])}
        if is_policy:  # a turn's reward sits at its last policy token
            turn["reward"] = rewards[columns[-1]]
        turns.append(turn)
    return turns


def _runs(policy: Sequence[bool], real: Sequence[bool]) -> list[tuple[list[int], bool]]:
    """The columns of each maximal run of real tokens of one kind (the policy's or not), in order;
    padding between two tokens of one kind does not split their run."""
    runs: list[tuple[list[int], bool]] = []
    for column, (is_policy, is_real) in enumerate(zip(policy, real)):
        if not is_real:
            continue
        if runs and runs[-1][1] == is_policy:
            runs[-1][0].append(column)
        else:
            runs.append(([column], is_policy))
    return runs
