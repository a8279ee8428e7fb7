"""`@estimator`: write an advantage estimator for ONE group, get a batched traceable op.

    @F.estimator
    def leave_one_out(r):                      # r: f32[n], the rewards of one prompt's samples
        return r - (r.sum() - r) / (r.shape[0] - 1)

    adv = leave_one_out(rewards, ro.group, n=n)    # f32[N] -> f32[N], one node in the program

The decorated function takes `(rewards f32[N], group i64[N], *per_row, n=<group size>, **hparams)`,
cuts every per-row tensor ([N, ...]) into B = N / n contiguous groups of n rows (row i*n + j is
sample j of prompt i, as `rg.generate` lays them out), applies `fn` to each group with
`torch.func.vmap` and stitches the results back to [N, ...]. `n` is a keyword because it cannot be
read from `group` while tracing (values are meta tensors then); shape inference uses the symbolic
group size `n`, so the program prints `f32[N]`. On real tensors the grouping is checked.

`fn` runs under `vmap`: tensor math only, no Python branches on values (use `torch.where`).
Every estimator made here is registered by name in `F.ESTIMATORS`, next to the built-ins, so
configs and the CLI can ask for it (`rlgraph trace grpo --import my_module -p estimator=leave_one_out`).
By name it is called `F.get_estimator("leave_one_out")(rewards, group, n=n, mask=mask)`: the mask is
passed on only if `fn` takes a per-row argument named `mask` (see `rlgraph.functional.registry`).
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from rlgraph.functional.registry import ESTIMATORS, get_estimator, register_estimator, same_definition
from rlgraph.ir import ops
from rlgraph.ir import specs as S
from rlgraph.errors import SourceLocation, TraceError
from rlgraph.ir.ops import traceable


def _check_groups(group: Tensor, n: int, name: str) -> None:
    """Real tensors only: rows i*n .. i*n+n-1 must share one group id."""
    if group.device.type == "meta":
        return
    blocks = group.reshape(-1, n)  # [B, n]
    if not bool((blocks == blocks[:, :1]).all()):
        raise ValueError(
            f"{name}: groups must be contiguous blocks of n={n} rows (row i*n+j is sample j of prompt i), "
            "as rg.generate lays them out; got group ids " + str(group.tolist()[:4 * n])
        )


def _check_name_free(name: str, per_group: Callable[..., Tensor]) -> None:
    """Refuse a name held by a built-in op or another estimator; re-running the same definition is fine."""
    op = ops.OPS.get(name)
    if op is not None and not same_definition(op, per_group):
        raise ValueError(f"estimator name {name!r} is taken by the op {op.__module__}.{name}; "
                         "rename the function or pass @estimator(name=...)")
    entry = ESTIMATORS.get(name)
    if entry is not None and not same_definition(entry.op, per_group):
        raise ValueError(f"estimator name {name!r} is registered already ({entry.op.__module__}.{entry.op.__qualname__}); "
                         "rename the function or pass @estimator(name=...)")


def estimator(fn: Callable[..., Tensor] | None = None, *, name: str | None = None):
    """Decorator: `@estimator` or `@estimator(name=...)` on `fn(r: f32[n], *per_row_of_group) -> f32[n]`.

    Returns the batched traceable op (`op.per_group` is `fn`), registered in `F.ESTIMATORS` as `name`
    (default: `fn.__name__`).
    """

    def wrap(per_group: Callable[..., Tensor]) -> Callable[..., Tensor]:
        op_name = name or per_group.__name__
        _check_name_free(op_name, per_group)
        op = traceable(name=op_name)(_batched(per_group, op_name))
        op.per_group = per_group  # type: ignore[attr-defined]
        register_estimator(op_name, op)
        return op

    return wrap(fn) if fn is not None else wrap


def _batched(per_group: Callable[..., Tensor], op_name: str) -> Callable[..., Tensor]:
    """`per_group` applied to every contiguous group of n rows with `vmap`: [N, ...] -> [N, ...]."""

    def batched(rewards: Tensor, group: Tensor, *per_row: Tensor, n: int, **hparams: Any) -> Tensor:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"{op_name}: n must be the group size, a positive int; got {n!r}")
        if rewards.device.type == "meta" and n > 1:
            n = S.witness_size(S.n)  # tracing: N is the witness of B*n, so group with the witness of n (n=1: [B] rows)
        rows = rewards.shape[0]
        if rows % n:
            raise ValueError(f"{op_name}: {rows} rows do not split into groups of n={n}; pass the n given to rg.generate")
        for tensor in (group, *per_row):
            if tensor.shape[0] != rows:
                raise ValueError(f"{op_name}: every per-row argument needs {rows} rows, got shape {tuple(tensor.shape)}")
        _check_groups(group, n, op_name)
        grouped = [t.reshape(rows // n, n, *t.shape[1:]) for t in (rewards, *per_row)]  # [B, n, ...]
        try:
            out = torch.func.vmap(functools.partial(per_group, **hparams))(*grouped)  # [B, n, ...]
        except RuntimeError as error:
            raise _value_dependent(error, per_group, op_name) or error
        if out.shape[:2] != (rows // n, n):
            raise ValueError(f"{op_name}: the per-group function must return one value per row of the group "
                             f"([n, ...]), got {tuple(out.shape[1:])} for a group of {n}")
        return out.reshape(rows, *out.shape[2:])  # [N, ...]

    batched.__name__ = batched.__qualname__ = op_name
    batched.__doc__ = per_group.__doc__
    batched.__module__ = per_group.__module__
    return batched


def _value_dependent(error: RuntimeError, per_group: Callable, op_name: str) -> TraceError | None:
    """vmap's "data-dependent control flow ... file an issue at pytorch" (an `if` on a tensor, `.item()`)
    as rlgraph's own error at the line of the estimator that did it; None for any other error."""
    text = str(error)
    if "data-dependent control flow" not in text and ".item()" not in text:
        return None
    code = getattr(per_group, "__code__", None)
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if code and frame.filename == code.co_filename]
    where = SourceLocation(frames[-1].filename, frames[-1].lineno, frames[-1].name) if frames else None
    what = "`.item()`" if ".item()" in text else "a Python `if` (or `and`/`or`/`while`) on a tensor"
    return TraceError(
        f"@F.estimator {op_name}: {what}: the estimator runs on every group at once (torch.func.vmap), so a "
        "value of one group cannot choose a Python branch", where,
        fix="express the choice as tensor math (torch.where, masks, clamp), e.g. "
            "torch.where(r.max() > 0, r - r.mean(), torch.zeros_like(r)); a choice that is the same for every "
            "group is a keyword argument of the estimator")


__all__ = ["estimator", "get_estimator", "register_estimator"]  # the registry's functions too, for older imports
