"""Supervised multi-turn traces: the warm start of an agent, with observations as context.

A trace is a data row's list of turn texts, alternating the policy's and the environment's and
ending with the policy's: ["<tool>calculator(12*34)</tool>", "408", "408"]. It becomes one
demonstration row built as a rollout would be (the same observation markers, tokenized once):
the policy's turns are the targets (mask True, the last one ended by EOS), the observations are
context only (context_mask True, mask False).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rlgraph.agents.env import ObservationFormat
from rlgraph.batches import Rollouts
from rlgraph.data.prompts import PromptRow, to_prompts
from rlgraph.errors import ConfigError


def trace_ids(turns: Any, tokenizer: Any, format: ObservationFormat, where: str) -> tuple[list[int], list[bool]]:
    """(response ids, policy mask) of one trace."""
    if (not isinstance(turns, list) or not turns or len(turns) % 2 == 0
            or not all(isinstance(turn, str) for turn in turns)):
        raise ConfigError(f"{where}: a trace is a list of turn texts, the policy's and the environment's in turn, "
                          f"starting and ending with the policy's (an odd count), got {turns!r}",
                          fix='e.g. ["<tool>calculator(12*34)</tool>", "408", "408"]')
    ids: list[int] = []
    policy: list[bool] = []
    for index, turn in enumerate(turns):
        mine = index % 2 == 0
        text = turn if mine else format.before + turn + format.after
        piece = list(tokenizer.encode(text, add_special_tokens=False))
        if index == len(turns) - 1:
            piece.append(tokenizer.eos_token_id)  # the final answer ends the episode, as a sampled EOS does
        ids += piece
        policy += [mine] * len(piece)
    return ids, policy


def trace_demonstrations(rows: Sequence[PromptRow], tokenizer: Any, field: str, format: ObservationFormat | None
                         ) -> Rollouts:
    """SFT batch of multi-turn traces (`row.fields[field]`), right-padded, observations masked out."""
    format = format or ObservationFormat()
    traced = []
    for row in rows:
        if field not in row.fields:
            raise ConfigError(f"{row.source}: no trace field {field!r} (the row has {', '.join(row.fields) or 'none'})",
                              fix=f"add {field!r} to data.extra_fields, and a trace to every training row")
        traced.append(trace_ids(row.fields[field], tokenizer, format, f"{row.source} field {field!r}"))
    steps = max(len(ids) for ids, _ in traced)
    response = torch.full((len(rows), steps), tokenizer.pad_token_id, dtype=torch.long)  # [B, T]
    mask = torch.zeros(len(rows), steps, dtype=torch.bool)  # [B, T]
    context = torch.zeros(len(rows), steps, dtype=torch.bool)  # [B, T]
    for index, (ids, policy) in enumerate(traced):
        response[index, :len(ids)] = torch.tensor(ids)
        mask[index, :len(ids)] = torch.tensor(policy)
        context[index, :len(ids)] = True
    demos = Rollouts.from_demonstrations(to_prompts(rows, tokenizer), response, mask)
    return Rollouts(demos.prompt_ids, demos.prompt_mask, demos.response_ids, demos.mask, demos.logprobs, demos.group,
                    demos.meta, context)
