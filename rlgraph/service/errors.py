"""The one error type of the service: a bad call, with the HTTP status it maps to and the field it names.

A `CallError` is the caller's mistake (a bad batch, an unknown model, another key's adapter): the
HTTP layer answers it with its `status` (4xx) and message, the in-process client raises it as is,
and it never changes a tenant's weights, optimizer or counters.
"""

from __future__ import annotations

from rlgraph.errors import RLGraphError


class CallError(RLGraphError, ValueError):
    """`field` names the part of the request that is wrong (`data[2].loss_fn_inputs.weights`,
    `sampling_params.top_k`, `model_id`); `fix` says what to send instead."""

    def __init__(self, message: str, *, field: str | None = None, status: int = 400, fix: str | None = None):
        self.summary, self.field, self.status, self.fix = message, field, status, fix
        where = f"{field}: " if field else ""
        super().__init__(where + message + (f"\n  fix: {fix}" if fix else ""))


def not_found(what: str, name: str, field: str) -> CallError:
    """The same answer for "does not exist" and "belongs to another key", so a key cannot probe
    which names other keys use."""
    return CallError(f"no {what} {name!r} for this API key", field=field, status=404,
                     fix=f"use a {what} this key created (ids are returned by the call that created it)")
