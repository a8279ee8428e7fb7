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
Every estimator made here is registered by name in `ESTIMATORS` for configs and the CLI.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from rlgraph.ir import specs as S
from rlgraph.ir import ops
from rlgraph.ir.ops import traceable

ESTIMATORS: dict[str, Callable[..., Tensor]] = {}


def register_estimator(name: str, fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """Make `fn(rewards, group, *per_row, n=..., **hparams)` available as `get_estimator(name)`."""
    old = ESTIMATORS.get(name)
    redefined = old is not None and (old.__module__, old.__qualname__) == (fn.__module__, fn.__qualname__)
    if old is not None and old is not fn and not redefined:
        raise ValueError(f"an estimator named {name!r} is already registered; pick another name")
    ESTIMATORS[name] = fn
    return fn


def get_estimator(name: str) -> Callable[..., Tensor]:
    if name not in ESTIMATORS:
        close = difflib.get_close_matches(name, list(ESTIMATORS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise KeyError(f"no estimator named {name!r}{hint} registered ones: {', '.join(sorted(ESTIMATORS)) or 'none'}")
    return ESTIMATORS[name]


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


def estimator(fn: Callable[..., Tensor] | None = None, *, name: str | None = None):
    """Decorator: `@estimator` or `@estimator(name=...)` on `fn(r: f32[n], *per_row_of_group) -> f32[n]`."""

    def wrap(per_group: Callable[..., Tensor]) -> Callable[..., Tensor]:
        op_name = name or per_group.__name__
        if op_name in ops.OPS and op_name not in ESTIMATORS:
            raise ValueError(f"estimator name {op_name!r} is taken by the op {ops.OPS[op_name].__module__}.{op_name}; "
                             "rename the function or pass @estimator(name=...)")

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
            out = torch.func.vmap(functools.partial(per_group, **hparams))(*grouped)  # [B, n, ...]
            if out.shape[:2] != (rows // n, n):
                raise ValueError(f"{op_name}: the per-group function must return one value per row of the group "
                                 f"([n, ...]), got {tuple(out.shape[1:])} for a group of {n}")
            return out.reshape(rows, *out.shape[2:])  # [N, ...]

        batched.__name__ = batched.__qualname__ = op_name
        batched.__doc__ = per_group.__doc__
        batched.__module__ = per_group.__module__
        op = traceable(name=op_name)(batched)
        op.per_group = per_group  # type: ignore[attr-defined]
        return register_estimator(op_name, op)

    return wrap(fn) if fn is not None else wrap
