"""File modes of what rlgraph writes: the user's umask, like any file they create themselves.

The temporary files and directories that make writes atomic (`tempfile.mkstemp` / `mkdtemp`) and
safetensors' own writer create 0600 files and 0700 directories; renamed into place, they would make
a checkpoint private while the config and metrics beside it are world-readable (0644 under the usual
umask 022). Every path rlgraph writes goes through `follow_umask` before it is renamed into place,
so one rule holds for the whole run directory and for exports: files 0666 & ~umask, directories
0777 & ~umask. A private run is `umask 077` before `rlgraph train` (docs/training.md).
"""

from __future__ import annotations

import os
from pathlib import Path


def current_umask() -> int:
    mask = os.umask(0)  # reading the umask means setting it: set it straight back
    os.umask(mask)
    return mask


def follow_umask(path: str | Path) -> None:
    """Give `path` (and, for a directory, everything under it) the modes the umask gives new files."""
    mask, path = current_umask(), Path(path)
    paths = [path, *path.rglob("*")] if path.is_dir() else [path]
    for item in paths:
        if not item.is_symlink():
            os.chmod(item, (0o777 if item.is_dir() else 0o666) & ~mask)
