"""The controller's rule for `rg.filter_groups`: keep groups, refill from fresh prompts.

This is the one refill loop: the eager interpreter and the plan runner (over every transport)
call `run_filter` when they reach a `filter_groups` node. They differ only in what one round
runs, which they pass in as `run_round`: the eager interpreter the region's nodes, the plan
runner the plan's loop steps (on whatever transport it drives).

Guarantees: the result has exactly B groups (B = the groups of the first round), ids 0..B-1,
each group's rows contiguous and in the order the groups were produced; kept groups come first,
in round order; dropped groups fill the rest only when `max_rounds` rounds kept fewer than B.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from rlgraph.batches import Prompts, Rollouts
from rlgraph.errors import RLGraphError, SourceLocation
from rlgraph.ir.primitives import RefillLoop

MorePrompts = Callable[[], Prompts]
LOG = logging.getLogger(__name__)


class RefillError(RLGraphError):
    """`rg.filter_groups` could not run: no prompt source, or a `keep` that splits a group."""


def _at(where: SourceLocation | None) -> str:
    return f"\n  at {where} in {where.function}():  {where.code}" if where is not None else ""


def require_prompt_source(loops: tuple[RefillLoop, ...], program: Any, more_prompts: MorePrompts | None) -> None:
    """Refuse, before any work, a program whose refill loop may need prompts when none can come."""
    needs = [loop for loop in loops if loop.max_rounds > 1]
    if needs and more_prompts is None:
        node = next(n for n in program.graph.nodes if n.name == needs[0].filter)
        raise RefillError(
            f"rg.filter_groups may draw up to {needs[0].max_rounds - 1} more batches of prompts, but this run "
            f"was given no prompt source{_at(node.meta.get('source'))}\n"
            "  fix: pass one, e.g. runner.run(batch, more_prompts=lambda: next_prompts()) (or "
            "interpreter.run(program, batch, more_prompts=...); the Trainer passes its next_batch), or set "
            "max_rounds=1 to filter without refilling"
        )


def _groups(rollouts: Rollouts, rewards: torch.Tensor, keep: torch.Tensor, where: SourceLocation | None):
    """Split one round into groups, in order of first appearance: [(rows, keep?)]."""
    ids = rollouts.group.tolist()
    rows_of: dict[int, list[int]] = {}
    for row, gid in enumerate(ids):
        rows_of.setdefault(gid, []).append(row)
    out = []
    for gid, rows in rows_of.items():
        flags = keep[rows]
        if bool(flags.any()) != bool(flags.all()):
            raise RefillError(f"rg.filter_groups: keep must be the same for every row of a group; group {gid} "
                              f"has {flags.tolist()}{_at(where)}\n  fix: compute keep per group, e.g. "
                              "F.group_has_variance(r, ro.group)")
        out.append((rollouts.select(rows), rewards[rows], bool(flags.all())))
    return out


def _nothing_kept(rounds: int, drawn: int, where: SourceLocation | None) -> str:
    """Every group of every round was dropped: this step learns nothing (zero advantages); say why."""
    return (
        f"rg.filter_groups kept no group in {rounds} rounds ({drawn} groups drawn): keep was False for every "
        f"group, e.g. every sample of a prompt got the same reward; the batch is filled with dropped groups{_at(where)}\n"
        "  fix: if this repeats, check the reward function (does it ever differ within a prompt?), sample more "
        "(n, temperature), use easier prompts, or raise max_rounds"
    )


def run_filter(node: fx.Node, env: dict[fx.Node, Any], prompts: fx.Node, run_round: Callable[[dict[fx.Node, Any]], None],
               more_prompts: MorePrompts | None) -> tuple[Rollouts, torch.Tensor, dict[str, float]]:
    """Evaluate a `filter_groups` node whose inputs hold the first round's values in `env`.

    Each further round binds fresh prompts (`more_prompts()`) to the input node `prompts` in a copy
    of `env` and calls `run_round(copy)`, which must evaluate the loop's region there; the first
    round's values in `env` stay as they are. Returns (rollouts, rewards, statistics).
    """

    def rerun(batch: Prompts) -> dict[fx.Node, Any]:
        fresh = dict(env)
        fresh[prompts] = batch
        run_round(fresh)
        return fresh

    where = node.meta.get("source")
    first = _groups(*(env[arg] for arg in node.args[:3]), where)
    target = len(first)
    kept = [group for group in first if group[2]]
    dropped = [group for group in first if not group[2]]
    rounds, cap = 1, node.kwargs["max_rounds"]
    while len(kept) < target and rounds < cap:
        fresh = rerun(more_prompts())  # the caller checked the source exists (require_prompt_source)
        for group in _groups(*(fresh[arg] for arg in node.args[:3]), where):
            (kept if group[2] else dropped).append(group)
        rounds += 1
        # progress: a refill that keeps little is slow, and the log says why (and how far it got)
        LOG.info("rg.filter_groups: round %d/%d, kept %d of %d groups", rounds, cap, min(len(kept), target), target)
    if not kept and rounds > 1:  # a warning, not an error: early in training every group may tie for a few steps
        LOG.warning("%s", _nothing_kept(rounds, len(dropped), where))
    filled = max(0, target - len(kept))
    chosen = kept[:target] + dropped[:filled]
    rollouts = Rollouts.concat([group[0] for group in chosen])
    rewards = torch.cat([group[1] for group in chosen])  # [N]
    stats = {"rounds": float(rounds), "kept_groups": sum(group[2] for group in first) / max(target, 1),
             "filled_groups": float(filled)}
    return rollouts, rewards, stats
