"""Render a plan as a Graphviz diagram: one cluster per worker group, steps as nodes in order,
collectives as labelled edges between groups, refill loops as dashed back edges."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlgraph.plan.plan import Plan

_PHASE_COLOURS = {"generate": "#cfe8ff", "infer": "#e6f5d0", "train": "#ffd9b3", "reward": "#f2e0ff", "controller": "#eeeeee",
                  "filter": "#fde2e4", "fields": "#fafafa"}


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def plan_to_dot(plan: Plan) -> str:
    from rlgraph.plan.plan import Offload, Stage, SyncWeights, Transfer

    lines = ["digraph plan {", "  rankdir=TB; node [shape=box, style=\"rounded,filled\", fontname=Helvetica, fontsize=10];",
             f"  label={_quote(f'{plan.algorithm} on {plan.mesh}, {plan.placement}')}; labelloc=t;"]
    members: dict[str, list[str]] = {}
    for step in plan.steps:
        name = f"s{step.index}"
        if isinstance(step, Stage):
            label = f"[{step.index}] {step.phase}\\n" + "\\n".join(step.ops[:6]) + ("\\n..." if len(step.ops) > 6 else "")
            lines.append(f"  {name} [label={_quote(label)}, fillcolor={_quote(_PHASE_COLOURS.get(step.phase, '#ffffff'))}];")
            members.setdefault(step.group, []).append(name)
        elif isinstance(step, Transfer):
            lines.append(f"  {name} [shape=cds, fillcolor=\"#fff3b0\", label={_quote(f'[{step.index}] {step.kind} {step.value}  {step.bytes:,} B')}];")
        elif isinstance(step, SyncWeights):
            lines.append(f"  {name} [shape=cds, fillcolor=\"#ffc9c9\", label={_quote(f'[{step.index}] sync_weights {step.version}  {step.bytes:,} B x{step.buckets}')}];")
        elif isinstance(step, Offload):
            lines.append(f"  {name} [shape=note, fillcolor=\"#dddddd\", label={_quote(f'[{step.index}] {step.direction} {step.what}')}];")
            members.setdefault(step.group, []).append(name)
    for group, names in members.items():
        ranks = next((g.ranks_text() for g in plan.groups if g.name == group), "controller")
        lines.append(f"  subgraph cluster_{group} {{ label={_quote(f'{group} ({ranks})')}; style=dashed; {' '.join(names)}; }}")
    for before, after in zip(plan.steps, plan.steps[1:]):
        lines.append(f"  s{before.index} -> s{after.index};")
    for loop in plan.loops:  # the refill loop: back from the filter to the first step it re-runs
        label = f"refill on fresh {loop.prompts}, <= {loop.max_rounds} rounds"
        lines.append(f"  s{loop.filter_step} -> s{loop.steps[0]} [style=dashed, constraint=false, label={_quote(label)}];")
    lines.append("}")
    return "\n".join(lines)


def render(dot_source: str, path: str) -> str | None:
    """Write `path` (.svg/.png) with Graphviz's `dot` if it is installed; returns the path or None."""
    import shutil
    import subprocess

    if shutil.which("dot") is None:
        return None
    fmt = path.rsplit(".", 1)[-1]
    subprocess.run(["dot", f"-T{fmt}", "-o", path], input=dot_source.encode(), check=True)
    return path
