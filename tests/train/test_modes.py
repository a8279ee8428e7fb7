"""rlgraph.train.modes: what rlgraph writes takes the user's umask, temporary files' 0600 included."""

from __future__ import annotations

import os
import stat
import tempfile

import pytest

from rlgraph.train.modes import current_umask, follow_umask


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_a_temporary_tree_takes_the_umask_of_ordinary_files(tmp_path, umask):
    before = os.umask(umask)
    try:
        tree = tempfile.mkdtemp(dir=tmp_path)             # 0700
        fd, file = tempfile.mkstemp(dir=tree)             # 0600
        os.close(fd)
        os.mkdir(os.path.join(tree, "inner"), 0o700)
        assert current_umask() == umask                   # reading it leaves it as it was
        follow_umask(tree)
        assert (mode(tree), mode(file), mode(os.path.join(tree, "inner"))) == (0o777 & ~umask, 0o666 & ~umask,
                                                                                0o777 & ~umask)
    finally:
        os.umask(before)
