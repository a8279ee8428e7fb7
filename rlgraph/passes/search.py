"""`placement="auto"`: enumerate placements, drop those that cannot fit, rank the rest by estimated
step time (`rlgraph.plan.cost`), and say why the winner wins.

    compiled = rg.compile(ppo, mesh="2x8:h100", placement="auto", models={"policy": "qwen2.5-7b"})
    print(compiled.search.text())     # the top k, their phases, the reason

Candidates, for a mesh of `nodes` x `per_node` ranks:
- colocated: FSDP shards dividing the mesh, generation tensor parallelism in {1, 2, 4, 8} dividing
  a node (and the model's attention heads), with and without offloading the trainer's state, with
  and without activation checkpointing (this and the split's);
- split: the policy's trainer on `p` ranks and its generator (`rollout`) on the rest, `p` a power
  of two, a multiple of a node, or the mesh less one of those; every other model role sharing
  either group; tp as above, aligned so no replica straddles the trainer's ranks.
A candidate whose memory check fails (`PlacementError`) is dropped, remembering how far short it
fell; the others are compiled in full and ranked by estimated seconds per iteration (with
`staleness` >= 1 the overlapped step time: a split whose lanes run at once is paid its slower lane
only, `CostAnalysis.step_seconds`), ties broken by the
placement's text, so the result is deterministic. The traced program's spec inference does not
depend on the placement and runs once.
"""

from __future__ import annotations

import difflib
import itertools
import re
import time
from collections.abc import Callable

import attrs

from rlgraph.ir.program import Program
from rlgraph.passes.options import CompileOptions, PlacementConfigError
from rlgraph.plan.cost import CostAnalysis, format_seconds
from rlgraph.plan.memory import GiB, MiB, KiB, PlacementError
from rlgraph.plan.mesh import Colocated, Placement, Split, colocated, split

AUTO = "auto"
TP_SIZES = (1, 2, 4, 8)
_SHORT = re.compile(r"short by ([\d.]+) (GiB|MiB|KiB|B)\b")
_UNITS = {"GiB": GiB, "MiB": MiB, "KiB": KiB, "B": 1}


@attrs.frozen
class Candidate:
    placement: Placement
    text: str  # the plan's placement text
    cost: CostAnalysis | None = None
    compiled: object = None  # the `Compiled` of a feasible candidate
    error: str = ""  # why it was dropped
    shortfall: int = 0  # bytes it lacks on its fullest rank


@attrs.frozen
class SearchResult:
    """Feasible candidates best first, the number dropped, the closest infeasible one, the time taken."""

    ranked: tuple[Candidate, ...]
    dropped: int
    closest_infeasible: Candidate | None
    seconds: float
    top_k: int = 3

    @property
    def best(self) -> Candidate:
        return self.ranked[0]

    def text(self) -> str:
        lines = [f"placement search: {len(self.ranked) + self.dropped} candidates, {self.dropped} dropped "
                 f"(do not fit or cannot run), {len(self.ranked)} ranked in {self.seconds:.2f} s"]
        for rank, candidate in enumerate(self.ranked[: self.top_k], 1):
            lines.append(f"  #{rank} {candidate.text:<58} {format_seconds(candidate.cost.step_seconds):>9}  "
                         f"({candidate.cost.phases_text()})")
        lines.append("why: " + explain(self.ranked))
        return "\n".join(lines)


def explain(ranked: tuple[Candidate, ...]) -> str:
    """What dominates the winner's step, and the phases the runner-up loses on."""
    best = ranked[0]
    dominant = best.cost.dominant()
    share = best.cost.phases[dominant] / best.cost.total
    why = f"{best.text} is fastest; {dominant} dominates its step ({100 * share:.0f}%)"
    if len(ranked) < 2:
        return why + "; it is the only placement that fits"
    runner = ranked[1]
    ours, theirs = best.cost.phases, runner.cost.phases
    losses = sorted(((theirs.get(p, 0.0) - ours.get(p, 0.0), p) for p in set(ours) | set(theirs)), reverse=True)
    lost = [f"{phase} +{format_seconds(delta)}" for delta, phase in losses if delta > 0][:2]
    gained = [f"{phase} -{format_seconds(-delta)}" for delta, phase in losses if delta < 0][:1]
    gap = runner.cost.step_seconds - best.cost.step_seconds
    if not lost or gap <= 1e-9 * best.cost.step_seconds:
        return why + f". The runner-up {runner.text} is estimated the same: a tie, broken by the placements' text"
    return (why + f". The runner-up {runner.text} is {format_seconds(gap)} slower: it loses on " + ", ".join(lost)
            + (f" and gains only {gained[0]}" if gained else ""))


def check_auto(placement: str) -> None:
    """Refuse a placement string other than "auto", suggesting the closest."""
    if placement != AUTO:
        close = difflib.get_close_matches(placement.lower(), [AUTO], n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise PlacementConfigError(f"unknown placement {placement!r}{hint}\n  fix: placement='auto' (the compiler chooses), "
                                   "rg.colocated(...), rg.split({...}) or rg.explicit(...)")


def _tp_sizes(options: CompileOptions, heads: int) -> list[int]:
    if options.generation_engine == "native":
        return [1]
    mesh = options.mesh
    return [tp for tp in TP_SIZES if mesh.per_node % tp == 0 and heads % tp == 0]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(used: dict[str, set[str]], options: CompileOptions, heads: int) -> list[Placement]:
    """Every placement the search compiles, in a fixed order; options a program cannot use (tp
    without a `generate`, shards, checkpointing and offload without an `update`) are left out."""
    mesh, roles = options.mesh, set(used)
    phases = set().union(*used.values()) if used else set()
    tps = _tp_sizes(options, heads) if "generate" in phases else [1]
    trains = "train" in phases
    shards = _divisors(mesh.size) if trains else [mesh.size]
    ckpts = (True, False) if trains else (True,)
    offloads = (True, False) if trains and "generate" in phases else (False,)
    out: list[Placement] = [colocated(fsdp=fsdp, tp=tp, offload=offload, checkpointing=ckpt)
                            for fsdp in shards for tp in tps if mesh.size % tp == 0
                            for offload in offloads for ckpt in ckpts]
    if "policy" not in roles or mesh.size < 2 or not trains or "generate" not in phases:
        return out
    chunks = {2 ** k for k in range(mesh.size.bit_length()) if 2 ** k < mesh.size}
    chunks |= {k * mesh.per_node for k in range(1, mesh.nodes)}
    trainers = sorted(chunks | {mesh.size - chunk for chunk in chunks})
    others = sorted(roles - {"policy", "rollout"})
    for policy in trainers:
        rollout = mesh.size - policy
        for shares in itertools.product(("policy", "rollout"), repeat=len(others)):
            groups = {"policy": policy, "rollout": rollout, **dict(zip(others, shares))}
            out.extend(split(groups, tp=tp, checkpointing=ckpt) for tp in tps if rollout % tp == 0 and policy % tp == 0
                       for ckpt in ckpts)
    return out


def describe(placement: Placement, options: CompileOptions) -> str:
    """How to write `placement` in Python: `colocated(fsdp=8, tp=4, offload=False, checkpointing=False)`."""
    ckpt = "" if placement.checkpointing else ", checkpointing=False"
    if isinstance(placement, Colocated):
        return f"colocated(fsdp={placement.fsdp or options.mesh.size}, tp={placement.tp}, offload={placement.offload}{ckpt})"
    assert isinstance(placement, Split)
    return f"split({dict(placement.groups)}, tp={placement.tp}{ckpt})"


def search(program: Program, options: CompileOptions, compile_rest: Callable, *, top_k: int = 3) -> SearchResult:
    """Compile every candidate placement of `program` (spec inference already run), rank the ones
    that fit. `compile_rest(program, options)` runs the passes after `infer_specs` and returns a
    `Compiled`. Raises `PlacementError` naming the closest candidate when none fits."""
    from rlgraph.passes.memory_plan import model_shape
    from rlgraph.passes.partition import partition
    from rlgraph.passes.place import roles_used

    start = time.perf_counter()
    used = roles_used(partition(program, attrs.evolve(options, placement=Colocated())))
    heads = model_shape(options, "policy").heads
    feasible, dropped, closest = [], 0, None
    for placement in candidates(used, options, heads):
        trial = attrs.evolve(options, placement=placement)
        try:
            compiled = compile_rest(program, trial)
        except PlacementError as exc:
            dropped += 1
            found = _SHORT.search(str(exc))
            short = int(float(found.group(1)) * _UNITS[found.group(2)]) if found else 1 << 62
            if closest is None or short < closest.shortfall:
                closest = Candidate(placement, describe(placement, options), error=str(exc), shortfall=short)
            continue
        except PlacementConfigError:
            dropped += 1
            continue
        feasible.append(Candidate(placement, describe(placement, options), compiled.plan.cost_analysis(), compiled))
    if not feasible:
        raise PlacementError(_nothing_fits(options, dropped, closest, _micro_batch_sizes(program)))
    ranked = tuple(sorted(feasible, key=lambda c: (c.cost.step_seconds, c.text)))
    return SearchResult(ranked, dropped, closest, time.perf_counter() - start, top_k)


def _micro_batch_sizes(program: Program) -> set:
    from rlgraph.ir.primitives import primitive_name

    return {node.kwargs.get("micro_batch_size") for node in program.nodes if primitive_name(node) == "update"}


def _nothing_fits(options: CompileOptions, tried: int, closest: Candidate | None, micro_sizes: set = frozenset()) -> str:
    head = f"placement='auto': no placement fits on the mesh {options.mesh} ({tried} candidates tried)"
    if closest is None:
        return head
    # micro_batch_size=1 everywhere: there is no smaller micro-batch to suggest
    sizes = "B, P, T" if micro_sizes == {1} else "B, P, T, micro_batch_size"
    return (f"{head}; the closest, {closest.text}, is short by {closest.shortfall / GiB:.2f} GiB per rank:\n  "
            + closest.error.replace("\n", "\n  ")
            + f"\n  fix: a larger mesh, a device with more memory, a smaller model or smaller sizes ({sizes})")
