"""`RolloutBatch`: the small, fully visible batch the property checkers feed to user functions.

A checker draws one of these, calls the user's function on it (and on transformed copies: padded,
permuted, split into micro-batches) and compares. Every field a loss or estimator usually reads is
there, as plain tensors, so a user adapts their function with a lambda:

    rgt.assert_padding_invariant(lambda b: F.gae(b.token_rewards, b.values, b.mask)[0])

Conventions (as `rg.generate` lays rollouts out): N rows in contiguous groups (`group` holds the
prompt index of each row), responses right-padded to T tokens, `mask` true on real tokens.
`to_source()` renders the batch as Python that rebuilds it exactly: that is the counterexample a
failing check prints.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import torch
from torch import Tensor

# Fields with one value per token ([N, T]); the rest are per row ([N]).
TOKEN_FIELDS = ("logprobs", "old_logprobs", "ref_logprobs", "advantages", "values", "old_values", "returns",
                "token_rewards")
ROW_FIELDS = ("rewards", "group")
FIELDS = ("rewards", "group", "mask", *TOKEN_FIELDS)


@attrs.frozen(eq=False)
class RolloutBatch:
    """N rollouts of T tokens in groups; `logprobs` is the variable a loss differentiates."""

    rewards: Tensor          # f[N]     sequence rewards, with ties and extremes
    group: Tensor            # i64[N]   prompt index of each row, contiguous blocks
    mask: Tensor             # bool[N, T] right-padded response mask (rows may be empty)
    logprobs: Tensor         # f[N, T]  current policy log-probs (<= 0)
    old_logprobs: Tensor     # f[N, T]  sampling log-probs (<= 0); log-ratios up to the drawn bound
    ref_logprobs: Tensor     # f[N, T]  reference log-probs (<= 0)
    advantages: Tensor       # f[N, T]  token advantages (use [:, :1] for sequence-level ones)
    values: Tensor           # f[N, T]  critic values
    old_values: Tensor       # f[N, T]  critic values at sampling time
    returns: Tensor          # f[N, T]  value targets
    token_rewards: Tensor    # f[N, T]  per-token rewards

    def __attrs_post_init__(self) -> None:
        rows, length = self.mask.shape
        for name in ROW_FIELDS:
            if getattr(self, name).shape != (rows,):
                raise ValueError(f"RolloutBatch.{name} must be [N]=[{rows}], got {tuple(getattr(self, name).shape)}")
        for name in TOKEN_FIELDS:
            if getattr(self, name).shape != (rows, length):
                raise ValueError(f"RolloutBatch.{name} must be [N, T]=[{rows}, {length}], "
                                 f"got {tuple(getattr(self, name).shape)}")

    @property
    def N(self) -> int:  # noqa: N802 - the symbolic dim's name
        return self.mask.shape[0]

    @property
    def T(self) -> int:  # noqa: N802
        return self.mask.shape[1]

    @property
    def groups(self) -> list[Tensor]:
        """Row indices of each group, in order of first appearance."""
        seen: dict[int, list[int]] = {}
        for row, gid in enumerate(self.group.tolist()):
            seen.setdefault(gid, []).append(row)
        return [torch.tensor(rows) for rows in seen.values()]

    @property
    def n(self) -> int | None:
        """The group size when every group has the same size (what `@rg.estimator` needs), else None."""
        sizes = {len(rows) for rows in self.groups}
        return sizes.pop() if len(sizes) == 1 else None

    def replace(self, **fields: Tensor) -> RolloutBatch:
        return attrs.evolve(self, **fields)

    def select(self, rows: Sequence[int] | Tensor) -> RolloutBatch:
        """Rows `rows`, in that order (a micro-batch, a shard, a permutation)."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        return RolloutBatch(**{name: getattr(self, name)[rows] for name in FIELDS})

    def relabel(self, labels: Sequence[int] | Tensor) -> RolloutBatch:
        """Group ids mapped through `labels` (old id -> new id)."""
        return self.replace(group=torch.as_tensor(labels, dtype=torch.long)[self.group])

    def padded(self, extra: int, fill: RolloutBatch | float) -> RolloutBatch:
        """`extra` more padding columns, and every padded position (old and new) taken from `fill`.

        `fill` is a batch of shape [N, T + extra] whose values are used wherever `mask` is false,
        or one constant (e.g. NaN for the strictest check). Unmasked values are unchanged.
        """
        mask = torch.nn.functional.pad(self.mask, (0, extra))  # [N, T+extra]
        out = {"rewards": self.rewards, "group": self.group, "mask": mask}
        for name in TOKEN_FIELDS:
            value = torch.nn.functional.pad(getattr(self, name), (0, extra))  # [N, T+extra]
            garbage = getattr(fill, name) if isinstance(fill, RolloutBatch) else torch.full_like(value, fill)
            out[name] = torch.where(mask, value, garbage)
        return RolloutBatch(**out)

    def to_rollouts(self):
        """The batch as `rg.Rollouts` (prompt and response ids are zeros: functions of ids are not tested here)."""
        from rlgraph.batches import Rollouts

        rows = self.N
        return Rollouts(torch.zeros(rows, 1, dtype=torch.long), torch.ones(rows, 1, dtype=torch.bool),
                        torch.zeros(rows, self.T, dtype=torch.long), self.mask, self.old_logprobs, self.group)

    def to_source(self, name: str = "batch", fields: Iterable[str] | None = None) -> str:
        """Python that rebuilds this batch (only `fields`, plus the structure, when given)."""
        wanted = set(FIELDS if fields is None else fields) | {"group", "mask"}
        dtype = _dtype_name(self.logprobs.dtype)
        lines = [f"{name} = RolloutBatch.of("]
        for field in FIELDS:
            if field in wanted:
                lines.append(f"    {field}={_literal(getattr(self, field))},")
        lines.append(f"    dtype={dtype},")
        lines.append(")")
        return "\n".join(lines)

    @classmethod
    def of(cls, *, group: Sequence[int], mask: Sequence[Sequence[bool]], dtype: torch.dtype = torch.float32,
           **fields: Sequence) -> RolloutBatch:
        """Build a batch from lists; fields not given are zeros. What `to_source` snippets call."""
        mask_t = torch.tensor(mask, dtype=torch.bool).reshape(len(group), -1)  # [N, T]
        unknown = set(fields) - set(FIELDS)
        if unknown:
            raise TypeError(f"RolloutBatch.of: unknown field(s) {sorted(unknown)}; fields are {', '.join(FIELDS)}")
        out: dict[str, Tensor] = {"group": torch.tensor(group, dtype=torch.long), "mask": mask_t}
        out["rewards"] = torch.tensor(fields.get("rewards", [0.0] * len(group)), dtype=dtype)
        for name in TOKEN_FIELDS:
            value = fields.get(name)
            out[name] = torch.zeros(mask_t.shape, dtype=dtype) if value is None else torch.tensor(value, dtype=dtype).reshape(mask_t.shape)
        return cls(**out)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # hypothesis prints draws with this
        printer.text(repr(self))

    def __repr__(self) -> str:
        return self.to_source("RolloutBatch")[len("RolloutBatch = "):]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype)  # "torch.float32"


def _literal(tensor: Tensor) -> str:
    """A tensor as a nested Python list literal that round-trips exactly (floats via repr)."""
    return _python(tensor.tolist())


def _python(value) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_python(v) for v in value) + "]"
    if isinstance(value, float) and not math.isfinite(value):
        return f"float('{value}')"
    return repr(value)
