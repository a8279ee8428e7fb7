"""What rlgraph wrote in a run directory: its manifest, `RUN_DIR/rlgraph-manifest.json`.

rlgraph deletes or replaces only what it wrote, and it knows what it wrote because it records each
top-level entry of the run directory (a file or a directory) here when it creates it: `config.yaml`,
`metrics.jsonl`, each `step-*` checkpoint, `base.safetensors`, `plots/`, ... A `step-best` the user
copied, a `step-notes/` folder or their own `config.yaml` are not in it, so no resume, prune or fresh
run deletes or overwrites them (a fresh run into a directory holding them is refused unless
`overwrite`). Files rlgraph reads back (`config.yaml`, `base.safetensors`) are recorded with their
sha256 and checked on every read; the manifest itself carries the sha256 of its entries, so an edit
of it is refused too. The controller alone writes it (workers only write inside directories it made).

    claim(run_dir, "config.yaml", sha256=file_sha256(path))   # after writing it
    owns(run_dir, "step-000004")                              # True: rlgraph wrote it
    foreign_entries(run_dir)                                  # ["notes.txt"]: what rlgraph did not write
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from rlgraph.errors import ConfigError
from rlgraph.train.modes import follow_umask

MANIFEST = "rlgraph-manifest.json"
_FORMAT = 1


class ManifestError(ConfigError):
    """The manifest, or a file it records, is not what rlgraph wrote: names the file and the fix."""


def _digest(entries: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(entries, sort_keys=True).encode()).hexdigest()


def read_manifest(run_dir: str | Path) -> dict[str, dict[str, Any]]:
    """The entries rlgraph recorded in `run_dir` ({} when it has no manifest); a damaged or edited
    manifest is refused (a ManifestError), never trusted: it decides what may be deleted."""
    path = Path(run_dir) / MANIFEST
    if not path.is_file() or path.is_symlink():
        if path.is_symlink():
            raise ManifestError(f"{path} is a symbolic link; rlgraph writes its manifest as a plain file",
                                fix=f"replace the link by the run's own {MANIFEST}, or choose another run_dir")
        return {}
    try:
        payload = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ManifestError(f"{path} cannot be read as JSON ({type(error).__name__}); it is damaged",
                            fix="restore it from a backup, or start a new run in another run_dir") from None
    entries = payload.get("entries") if isinstance(payload, dict) else None
    if (not isinstance(entries, dict) or not all(isinstance(v, dict) for v in entries.values())
            or payload.get("sha256") != _digest(entries)):
        raise ManifestError(f"{path} is not the manifest rlgraph wrote: its sha256 does not match its entries "
                            "(an edit, a flipped bit or another program's file)",
                            fix="restore it from a backup, or start a new run in another run_dir")
    return entries


def _write(run_dir: Path, entries: dict[str, dict[str, Any]]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=run_dir, prefix=f".{MANIFEST}.")
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump({"format": _FORMAT, "entries": entries, "sha256": _digest(entries)}, handle, indent=1,
                      sort_keys=True)
            handle.flush()
            os.fsync(handle.fileno())
        follow_umask(tmp)  # mkstemp makes 0600: the run directory's one rule (rlgraph.train.modes)
        os.replace(tmp, run_dir / MANIFEST)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def claim(run_dir: str | Path, *names: str, sha256: str | None = None) -> None:
    """Record `names` (top-level entries of `run_dir`) as written by rlgraph, with `sha256` (of the
    one file named) when rlgraph reads it back."""
    run_dir = Path(run_dir)
    entries = read_manifest(run_dir)
    for name in names:
        assert Path(name).name == name and name != MANIFEST, f"claim: {name!r} is not a top-level entry"
        entries[name] = {} if sha256 is None else {"sha256": sha256}
    _write(run_dir, entries)


def release(run_dir: str | Path, *names: str) -> None:
    """Forget `names` (rlgraph deleted them, or a temporary directory was renamed)."""
    run_dir = Path(run_dir)
    entries = read_manifest(run_dir)
    if any(name in entries for name in names):
        _write(run_dir, {k: v for k, v in entries.items() if k not in names})


def owns(run_dir: str | Path, name: str, entries: dict[str, Any] | None = None) -> bool:
    """Whether rlgraph wrote `run_dir/name`: recorded in the manifest, and not a symbolic link (rlgraph
    never writes one, so a link in its place is someone else's)."""
    entries = read_manifest(run_dir) if entries is None else entries
    return name in entries and not (Path(run_dir) / name).is_symlink()


def foreign_entries(run_dir: str | Path) -> list[str]:
    """The top-level entries of `run_dir` rlgraph did not write (sorted); [] for a missing directory."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    entries = read_manifest(run_dir)
    return sorted(path.name for path in run_dir.iterdir()
                  if path.name != MANIFEST and not owns(run_dir, path.name, entries))


def recorded_sha256(run_dir: str | Path, name: str) -> str | None:
    """The sha256 rlgraph recorded for `run_dir/name` when it wrote it, or None."""
    return read_manifest(run_dir).get(name, {}).get("sha256")


def verify_recorded(run_dir: str | Path, name: str, file_sha256: Any, fix: str) -> None:
    """Refuse `run_dir/name` when its bytes are not those rlgraph recorded writing (when it recorded them)."""
    expected = recorded_sha256(run_dir, name)
    path = Path(run_dir) / name
    if expected is None:
        return
    if not path.is_file():
        raise ManifestError(f"{path} is missing: rlgraph wrote it and reads it back", fix=fix)
    if path.is_symlink() or file_sha256(path) != expected:
        raise ManifestError(f"{path} is not the file rlgraph wrote: its sha256 differs from the one recorded in "
                            f"{Path(run_dir) / MANIFEST} (an edit, a flipped bit or a replaced file)", fix=fix)


def remove_owned(run_dir: str | Path, path: Path) -> None:
    """Delete `path` (a top-level entry of `run_dir`) only if rlgraph wrote it; then forget it."""
    import shutil

    run_dir = Path(run_dir)
    assert path.parent.resolve() == run_dir.resolve(), f"remove_owned: {path} is not an entry of {run_dir}"
    if not owns(run_dir, path.name):
        raise ManifestError(f"refusing to delete {path}: rlgraph did not write it (it is not in {run_dir / MANIFEST})",
                            fix=f"move {path} out of the run directory yourself if it should go")
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    release(run_dir, path.name)
