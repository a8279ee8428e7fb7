"""Where a value of a lowered program lives, and the collective that moves it elsewhere.

A layout is `("controller",)` (the whole value on the driver) or `(ranks, split)`: a per-row value
cut into `split` contiguous row shards over `ranks`, or a value without rows replicated (`split`
1). The `reshard` pass writes layouts into the program; the runtime moves values between them.
Both read this module, so the compiler and the runtime cannot disagree on which collective a
move is.
"""

from __future__ import annotations

CONTROLLER = "controller"  # the role (and group name) of the driver, which is not a rank
Layout = tuple


def collective_kind(src: Layout, dst: Layout, per_row: bool) -> str:
    """The one collective that moves a value from layout `src` to layout `dst`.

    >>> collective_kind(("controller",), ((0, 1), 2), per_row=True)
    'scatter'
    """
    if src == (CONTROLLER,):
        return "scatter" if per_row else "broadcast"
    if dst == (CONTROLLER,):
        return "gather"
    return "all_to_all" if set(src[0]) == set(dst[0]) else "send_recv"
