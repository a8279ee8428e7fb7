"""`rg.column`: a per-row tensor the caller attached to a batch, read as a typed program value.

A batch's `meta` holds per-row values the reward functions read (reference answers). `column`
reads one of them as a tensor: `rg.column(ro, "advantages")` is f32[N,T] when every row holds
a float tensor [T] (`per_token=True`), or f32[N] when every row holds a number. It is how values
computed outside the program (advantages a client computed, per-token weights of a dataset)
enter a traced program: they move and split with the rows of their batch, and the printed
program shows where they are read.

    @rg.algorithm
    def offline_pg(state, ro: rg.Rollouts):
        adv = rg.column(ro, "advantages")                    # f32[N,T]
        policy = rg.update(state.policy, ro, lambda lp: -F.masked_sum(adv * lp, ro.mask))
        return state.replace(policy=policy), {}
"""

from __future__ import annotations

from typing import Any

import torch

from rlgraph.batches import BatchError
from rlgraph.ir import ops
from rlgraph.ir import specs as S
from rlgraph.errors import SpecError, TraceError, user_location


def _column_spec(record: Any, key: Any, *, per_token: bool) -> S.TensorSpec:
    if not isinstance(record, S.RecordSpec):
        raise SpecError(f"rg.column: the batch must be Prompts or Rollouts, got {record}", user_location(),
                        fix="rg.column(ro, 'advantages') on the algorithm's batch")
    if not isinstance(key, str) or not key.isidentifier():
        raise TraceError(f"rg.column: the key must be a name such as 'advantages', got {key!r}", user_location())
    if record.field(key) is not None:
        raise TraceError(f"rg.column: {key!r} is a field of {record.kind}; read it as batch.{key}", user_location())
    if not isinstance(per_token, bool):
        raise TraceError(f"rg.column: per_token must be True or False, got {per_token!r}", user_location())
    if per_token and record.kind != "Rollouts":
        raise SpecError(f"rg.column({key!r}, per_token=True): {record.kind} have no response tokens", user_location(),
                        fix="per_token=False for one number per row")
    return S.f32(record.rows, S.T) if per_token else S.f32(record.rows)


def read_column(batch: Any, key: str, *, per_token: bool = True) -> torch.Tensor:
    """`batch.meta[key]` as f32[rows, T] (per_token) or f32[rows], on the batch's device."""
    values = batch.meta.get(key) if hasattr(batch, "meta") else None
    if values is None:
        held = ", ".join(getattr(batch, "meta", {})) or "none"
        raise BatchError(f"rg.column: the batch has no metadata column {key!r} (it has: {held})\n  fix: build the "
                         f"batch with meta={{{key!r}: [one value per row]}}")
    home = batch.response_ids.device if hasattr(batch, "response_ids") else batch.ids.device
    width = batch.mask.shape[1] if per_token else None
    rows = []
    want = f"a float tensor [{width}] (one value per response token)" if per_token else "one number"
    for row, value in enumerate(values):
        try:
            tensor = torch.as_tensor(value, dtype=torch.float32)
        except (TypeError, ValueError, RuntimeError):
            raise BatchError(f"rg.column: meta[{key!r}] row {row} is {type(value).__name__} {value!r:.40}; each row "
                             f"needs {want}") from None
        if tensor.shape != ((width,) if per_token else ()):
            raise BatchError(f"rg.column: meta[{key!r}] row {row} has shape {tuple(tensor.shape)}; each row needs {want}")
        rows.append(tensor)
    return torch.stack(rows).to(home)  # [rows, T] or [rows]


def _column_op(batch: Any, key: str, *, per_token: bool = True) -> torch.Tensor:
    return read_column(batch, key, per_token=per_token)


_column_op.__rlgraph_op__ = ops.OpInfo("column", read_column, _column_spec, rows="row")  # type: ignore[attr-defined]
_column_op.__name__ = "column"


def column(batch: Any, key: str, *, per_token: bool = True) -> Any:
    """The per-row values `batch.meta[key]` as a tensor: f32[rows,T] (`per_token`) or f32[rows].

    Inside an algorithm it records one node; on a concrete batch it reads the values."""
    if not ops.ACTIVE_TRACERS:
        return read_column(batch, key, per_token=per_token)
    return ops.ACTIVE_TRACERS[-1].record_op(_column_op, (batch, key), {"per_token": per_token})
