"""Hypothesis strategies for RL dataflows: dims and specs, ragged rollout batches, micro-batch
splits, meshes and placements. Random well-typed algorithms live in `rlgraph.testing.programs`.

Every strategy draws small values on purpose: a counterexample is only useful if it is short
enough to read, and hypothesis shrinks toward the small end of each range (fewer groups, shorter
responses, empty rows, 0.0).
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Sequence

import torch
from hypothesis import strategies as st

from rlgraph.ir import specs as S
from rlgraph.plan.mesh import Colocated, Mesh, Split, colocated, split
from rlgraph.testing.batch import FIELDS, TOKEN_FIELDS, RolloutBatch

# Rewards come from a few levels so ties (all-equal groups) are common, plus extremes.
REWARD_LEVELS = (0.0, 1.0, 0.5, -1.0)
REWARD_EXTREMES = (1e4, -1e4, 1e-6)


# -- dims and specs -----------------------------------------------------------------------------


@st.composite
def sizes(draw, *, max_prompts: int = 4, max_group: int = 4, max_tokens: int = 8) -> dict[str, int]:
    """Concrete sizes for the symbolic dims, consistent with each other (N = B*n)."""
    b, n = draw(st.integers(1, max_prompts)), draw(st.integers(1, max_group))
    return {"B": b, "n": n, "N": b * n, "T": draw(st.integers(1, max_tokens)), "P": draw(st.integers(1, max_tokens)),
            "V": draw(st.integers(2, 64)), "H": draw(st.integers(1, 32))}


DTYPES = (torch.float32, torch.int64, torch.bool)


def tensor_specs(*, dims: Sequence[S.Dim] = (S.N, S.T, S.B), max_rank: int = 2) -> st.SearchStrategy[S.TensorSpec]:
    """`TensorSpec`s over the symbolic dims, e.g. f32[N,T], i64[N], bool[B]."""
    shapes = st.lists(st.sampled_from(list(dims)), min_size=0, max_size=max_rank).map(tuple)
    return st.builds(S.TensorSpec, shapes, st.sampled_from(DTYPES))


@st.composite
def tensors_of(draw, spec: S.TensorSpec, concrete: dict[str, int]) -> torch.Tensor:
    """A tensor of `spec` at `concrete` sizes (small integers as floats, so sums are exact)."""
    shape = [size if isinstance(size, int) else concrete[str(size)] for size in spec.shape]
    count = 1
    for size in shape:
        count *= size
    if spec.dtype == torch.bool:
        values = draw(st.lists(st.booleans(), min_size=count, max_size=count))
    else:
        values = draw(st.lists(st.integers(-8, 8), min_size=count, max_size=count))
    return torch.tensor(values, dtype=spec.dtype).reshape(shape)


# -- rollout batches ----------------------------------------------------------------------------


# Strategies are built once per distinct argument tuple and reused (`functools.cache` below). The
# composites draw from many small strategies per example; building and validating them afresh at each
# draw was ~95% of a property's time (tests/examples: 228 of 328 s in `rollout_batches`, the checked
# loss itself 5 s). A reused strategy draws exactly what a new equal one draws.


@functools.cache
def _integers(low: int, high: int) -> st.SearchStrategy[int]:
    return st.integers(low, high)


@functools.lru_cache(maxsize=1024)  # bounded: rows and a caller's strategies are keys
def _fixed_lists(values: st.SearchStrategy, size: int) -> st.SearchStrategy[list]:
    """Lists of exactly `size` draws of `values`."""
    return st.lists(values, min_size=size, max_size=size)


@functools.lru_cache(maxsize=256)
def _lists(values: st.SearchStrategy, low: int, high: int) -> st.SearchStrategy[list]:
    return st.lists(values, min_size=low, max_size=high)


@functools.cache
def reward_values(extremes: bool = True) -> st.SearchStrategy[float]:
    """Rewards: a few levels (so groups tie) and, unless `extremes=False`, huge and tiny values."""
    return st.sampled_from(REWARD_LEVELS + (REWARD_EXTREMES if extremes else ()))


@functools.cache
def _grid(low: float, high: float, step: float = 0.25) -> st.SearchStrategy[float]:
    """Floats on a grid of `step` (exact in float32, short to print, quick to shrink toward 0)."""
    return st.integers(round(low / step), round(high / step)).map(lambda i: i * step)


def _token_values(log_ratio: float, fields: Collection[str]) -> tuple[tuple[str, st.SearchStrategy[float]], ...]:
    """What to draw per token for each wanted field (`old_logprobs` = `logprobs` + a log-ratio)."""
    return _token_draws(log_ratio, frozenset(fields))


@functools.cache
def _token_draws(log_ratio: float, fields: frozenset[str]) -> tuple[tuple[str, st.SearchStrategy[float]], ...]:
    logprob, free = _grid(-30.0, 0.0), _grid(-10.0, 10.0)
    draws = {"logprobs": logprob, "log_ratio": _grid(-log_ratio, log_ratio), "ref_logprobs": logprob,
             **{name: free for name in TOKEN_FIELDS if name not in ("logprobs", "old_logprobs", "ref_logprobs")}}
    wanted = set(fields) | ({"logprobs", "log_ratio"} if "old_logprobs" in fields else set())
    return tuple((name, values) for name, values in draws.items() if name in wanted)


@st.composite
def _row(draw, cols: int, width: int, rewards: st.SearchStrategy[float], holes: bool, log_ratio: float,
         fields: Collection[str]) -> dict:
    """One rollout: its mask, reward and every token field (padded positions hold plausible values).

    Each list is drawn `width` (the largest T) long and cut to `cols`, so when hypothesis shrinks
    T the draws that follow stay aligned and the shrink succeeds.
    """
    if holes:
        mask = draw(_fixed_lists(st.booleans(), width))[:cols]
    else:
        length = draw(_integers(0, width))
        mask = [t < length for t in range(cols)]
    row = {"mask": mask, "rewards": draw(rewards) if "rewards" in fields else 0.0}
    for name, values in _token_values(log_ratio, fields):
        row[name] = draw(_fixed_lists(values, width))[:cols]
    return row


@functools.lru_cache(maxsize=256)
def _row_strategy(cols: int, width: int, rewards: st.SearchStrategy[float], holes: bool, log_ratio: float,
                  fields: frozenset[str]) -> st.SearchStrategy[dict]:
    return _row(cols, width, rewards, holes, log_ratio, fields)


@functools.lru_cache(maxsize=256)
def _block(row: st.SearchStrategy[dict], full: int, size: int) -> st.SearchStrategy[list]:
    """`full` rows drawn, the first `size` kept (shrinking the size keeps later draws aligned)."""
    return _fixed_lists(row, full).map(lambda rows: rows[:size])


def _assemble(groups: list[list[dict]], cols: int, dtype: torch.dtype) -> RolloutBatch:
    rows = [row for block in groups for row in block]

    def tensor(name: str) -> torch.Tensor:
        if name not in rows[0]:
            return torch.zeros(len(rows), cols, dtype=dtype)  # a field the function does not read
        return torch.tensor([row[name] for row in rows], dtype=dtype).reshape(len(rows), cols)

    fields = {name: tensor(name) for name in TOKEN_FIELDS if name != "old_logprobs"}
    fields["old_logprobs"] = (fields["logprobs"] + tensor("log_ratio")).clamp(max=0.0)
    return RolloutBatch(rewards=torch.tensor([row["rewards"] for row in rows], dtype=dtype),
                        group=torch.tensor([g for g, block in enumerate(groups) for _ in block], dtype=torch.long),
                        mask=torch.tensor([row["mask"] for row in rows], dtype=torch.bool).reshape(len(rows), cols),
                        **fields)


@st.composite
def rollout_batches(draw, *, groups: tuple[int, int] = (1, 3), group_size: tuple[int, int] = (1, 3),
                    length: tuple[int, int] = (1, 4), equal_groups: bool = True, holes: bool = False,
                    rewards: st.SearchStrategy[float] | None = None, log_ratio: float = 20.0,
                    dtype: torch.dtype = torch.float32, fields: Collection[str] = FIELDS) -> RolloutBatch:
    """Ragged rollout batches: contiguous groups, right-padded masks with empty rows, tied and
    extreme rewards, log-probs in [-30, 0] and log-ratios up to +-`log_ratio`.

    Token values lie on a grid of 0.25 (exact in float32, short in a counterexample). Groups and
    rows are drawn as lists, so hypothesis shrinks a failure by deleting whole groups and rows.
    `equal_groups=False` draws a size per group (what `@rg.estimator` refuses, plain torch
    estimators must handle); `holes=True` draws any mask instead of right-padded ones. `fields`
    limits the drawn values to the fields a function reads (the others are zeros), which keeps
    counterexamples short; the checkers find those fields by a probe call.
    """
    cols = draw(_integers(*length))
    row = _row_strategy(cols, length[1], reward_values() if rewards is None else rewards, holes, log_ratio,
                        frozenset(fields))
    if equal_groups:  # drawn full width and cut, so shrinking the size keeps later draws aligned
        block = _block(row, group_size[1], draw(_integers(*group_size)))
    else:
        block = _lists(row, *group_size)
    return _assemble(draw(_lists(block, *groups)), cols, dtype)


_NO_REWARD = st.just(0.0)


@st.composite
def padding_of(draw, batch: RolloutBatch, *, max_extra: int = 3, log_ratio: float = 20.0,
               fields: Collection[str] = FIELDS) -> tuple[int, RolloutBatch]:
    """(`extra` columns, a batch of plausible values for every padded position) for `batch.padded`."""
    extra = draw(_integers(0, max_extra))
    cols = batch.T + extra
    row = _row_strategy(cols, cols, _NO_REWARD, False, log_ratio, frozenset(fields))
    fill = _assemble([[draw(row) for _ in range(batch.N)]], cols, batch.logprobs.dtype)
    return extra, fill.replace(rewards=batch.rewards, group=batch.group)


@st.composite
def micro_batch_splits(draw, rows: int, *, max_pieces: int | None = None, width: int = 16) -> list[list[int]]:
    """A partition of range(rows) into non-empty, possibly non-contiguous micro-batches.

    At least `width` labels are drawn and the first `rows` used, so shrinking the batch (deleting
    rows) leaves the labels aligned.
    """
    pieces = max_pieces or max(rows, 1)
    count = max(rows, width)
    labels = draw(_fixed_lists(_integers(0, pieces - 1), count))[:rows]
    parts: dict[int, list[int]] = {}
    for row, label in enumerate(labels):
        parts.setdefault(label, []).append(row)
    return [parts[label] for label in sorted(parts)]


@st.composite
def group_permutations(draw, batch: RolloutBatch, *, contiguous: bool = True) -> tuple[list[int], list[int]]:
    """(row order, group relabelling) that permutes groups and rows within them.

    With `contiguous=True` groups stay contiguous blocks (rlgraph's layout); otherwise rows are
    shuffled freely (for estimators that only read `group`).
    """
    blocks = [rows.tolist() for rows in batch.groups]
    if contiguous:
        order = draw(st.permutations(range(len(blocks))))
        rows = [row for block in order for row in draw(st.permutations(blocks[block]))]
    else:
        rows = list(draw(st.permutations(range(batch.N))))
    ids = int(batch.group.max()) + 1 if batch.N else 0
    labels = list(draw(st.permutations(range(ids))))
    return rows, labels


# -- meshes and placements ----------------------------------------------------------------------


def meshes(*, max_nodes: int = 2, per_node: Sequence[int] = (1, 2, 4, 8), devices: Sequence[str] = ("h100",)) -> st.SearchStrategy[Mesh]:
    return st.builds(Mesh, st.sampled_from(list(devices)), st.integers(1, max_nodes), st.sampled_from(list(per_node)))


def _divisors(size: int) -> list[int]:
    return [d for d in range(1, size + 1) if size % d == 0]


@st.composite
def placements(draw, mesh: Mesh, roles: Sequence[str] = ("policy", "ref")) -> Colocated | Split:
    """A placement valid on `mesh` for `roles`: colocated (fsdp x tp dividing the mesh) or split
    (the policy's trainer and its `rollout` generator on disjoint ranks, other roles on their own
    ranks or sharing the policy's)."""
    size = mesh.size
    if size == 1 or draw(st.booleans()):
        fsdp = draw(st.sampled_from(_divisors(size)))
        return colocated(fsdp=fsdp, tp=draw(st.sampled_from(_divisors(size))), offload=draw(st.booleans()),
                         checkpointing=draw(st.booleans()), cpu_offload=draw(st.booleans()))
    others = [role for role in roles if role != "policy"]
    train = draw(st.integers(1, size - 1))
    groups: dict[str, int | str] = {"policy": train, "rollout": size - train}
    for role in others:
        groups[role] = "policy"  # share the trainer's ranks: always fits on the mesh
    common = sorted(set(_divisors(train)) & set(_divisors(size - train)))
    return split(groups, tp=draw(st.sampled_from(common)), checkpointing=draw(st.booleans()), cpu_offload=draw(st.booleans()))


@st.composite
def layouts(draw, mesh_size: int = 8) -> tuple:
    """A layout as the reshard pass writes it: ("controller",) or (ranks, dp split)."""
    if draw(st.integers(0, 3)) == 0:
        return ("controller",)
    first = draw(st.integers(0, mesh_size - 1))
    count = draw(st.integers(1, mesh_size - first))
    ranks = tuple(range(first, first + count))
    return ranks, draw(st.sampled_from(_divisors(count)))
