"""The project's error types and `user_location` (`rlgraph/errors.py`): which stack frame is the user's."""

from __future__ import annotations

import os

import rlgraph
from rlgraph.errors import user_location

_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(rlgraph.__file__)))


def _located_from(filename: str):
    """`user_location()` as called from a function whose code claims to live in `filename` (compiled, not
    written: the test leaves the checkout as it is)."""
    namespace: dict = {"user_location": user_location}
    exec(compile("def probe():\n    return user_location()\n", filename, "exec"), namespace)
    return namespace["probe"]()


def test_a_user_file_inside_the_rlgraph_checkout_is_the_users_line():
    """An editable install: the checkout holds rlgraph/ and the user's own files; only rlgraph/ is skipped."""
    mine = os.path.join(_CHECKOUT, "examples", "my_algorithm.py")
    where = _located_from(mine)
    assert (where.file, where.line, where.function) == (mine, 2, "probe")
    beside = os.path.join(_CHECKOUT, "my_algorithm.py")  # a script beside the Makefile
    assert _located_from(beside).file == beside


def test_rlgraph_frames_are_skipped_but_its_algorithms_are_named():
    inside = os.path.join(_CHECKOUT, "rlgraph", "ir", "trace.py")
    assert _located_from(inside).file == os.path.abspath(__file__)  # the caller outside rlgraph: this test
    builtin = os.path.join(_CHECKOUT, "rlgraph", "algorithms", "grpo.py")
    assert _located_from(builtin).file == builtin
    assert _located_from("<frozen runpy>").file == os.path.abspath(__file__)  # start-up code is nobody's line
