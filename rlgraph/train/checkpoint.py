"""Atomic, exact-resume checkpoints.

A checkpoint is a directory `step-<k>/` holding every trainable role's weights (safetensors),
its optimizer state, the executor's shuffling RNG and sampling stream, the data sampler's
position and the run's counters. It is written to a temporary sibling and renamed into place, and `latest` is replaced
atomically after that, so a crash leaves either the old or the new checkpoint, never half of one.
meta.json holds the sha256 of every other file, checked on load: a flipped bit is refused, not trained on;
meta.sha256 holds meta.json's own, so an edited step count or a deleted checksum is refused too. A LoRA run's
RUN_DIR/base.safetensors, which its checkpoints' adapters apply to, is recorded in meta.json by its sha256
(`run_files`) and checked whenever the checkpoint is read. Every directory a save creates is recorded in the
run's manifest (`rlgraph.train.manifest`): pruning and resuming delete only those, never a `step-best` the
user copied or a symbolic link.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from rlgraph.backends.local.state import CheckpointMismatch
from rlgraph.backends.protocols import ExecutorState, RoleState
from rlgraph.backends.state_files import check_parts, full_state, refuse_non_finite, untied
from rlgraph.errors import ConfigError
from rlgraph.train.manifest import (
    MANIFEST, claim, foreign_entries, owns, read_manifest, recorded_sha256, release, remove_owned,
)
from rlgraph.train.modes import follow_umask

BASE_FILE = "base.safetensors"  # a LoRA run's base after its warm start (the adapters merged into it)
META_SUM = "meta.sha256"  # the sha256 of meta.json, written beside it
_CHECKPOINT_NAME = re.compile(r"step-\d+")
_HASH_CHUNK = 1 << 20  # 1 MiB reads: the hash streams, a multi-GB weight file never sits in memory twice


class CheckpointSaveError(ConfigError):
    """A checkpoint could not be written (disk full, no permission, read-only file system); names the
    path, the cause and the fix. The previous checkpoint and `latest` are left as they were."""


def file_sha256(path: Path) -> str:
    """The sha256 of `path`'s bytes, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(_HASH_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _save_failed(error: OSError, run_dir: Path) -> CheckpointSaveError:
    """The OSError of a save as a CheckpointSaveError saying which file, why, and what to do."""
    causes = {errno.ENOSPC: ("the disk is full (ENOSPC)", f"free space on the file system of {run_dir}, or lower "
                             "checkpoint.keep_last, then resume"),
              errno.EDQUOT: ("the disk quota is exceeded (EDQUOT)", f"free space in your quota for {run_dir}, then resume"),
              errno.EACCES: ("permission denied (EACCES)", f"make {run_dir} writable by this user, or choose another run_dir"),
              errno.EPERM: ("operation not permitted (EPERM)", f"make {run_dir} writable by this user, or choose another run_dir"),
              errno.EROFS: ("the file system is read-only (EROFS)", "remount it read-write, or choose another run_dir")}
    cause, fix = causes.get(error.errno, (f"{type(error).__name__}: {error.strerror or error}", f"check {run_dir}"))
    what = f"checkpoint file {error.filename}" if error.filename else f"a checkpoint in {run_dir}"
    return CheckpointSaveError(f"cannot write {what}: {cause}; the checkpoint was not saved and "
                               f"{run_dir / 'latest'} still names the previous one (if any)", fix=fix)


def _write_json_atomic(path: Path, payload: Any) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(payload, handle, indent=1)
            handle.flush()
            os.fsync(handle.fileno())
        follow_umask(tmp)  # mkstemp makes 0600: the run directory's one rule (rlgraph.train.modes)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)  # a full disk leaves no half-written sibling behind
        raise


def save_checkpoint(run_dir: str | Path, step: int, state: Any, extra: dict[str, Any]) -> Path:
    """Write `run_dir/step-<step>` atomically and point `run_dir/latest` at it.

    `state` is an `ExecutorState`, a local executor, or a plan runner. A runner whose ranks hold
    FSDP2 shards (spmd, Ray) has each rank write its own rows (`rlgraph.backends.state_files`):
    nothing is gathered; any other is asked for the full state, written one file per role.
    """
    if not isinstance(state, ExecutorState) and not hasattr(state, "write_state"):
        state = state.export_state()
    run_dir = Path(run_dir)
    try:
        final = _save(run_dir, step, state, extra)
    except OSError as error:
        raise _save_failed(error, run_dir) from error
    try:
        claim(run_dir, "latest")
        _write_json_atomic(run_dir / "latest", {"path": final.name, "step": step})
    except OSError as error:  # `latest` still names the previous one: a step-* past it would be a stray branch
        remove_owned(run_dir, final)
        raise _save_failed(error, run_dir) from error
    return final


def _save(run_dir: Path, step: int, state: Any, extra: dict[str, Any]) -> Path:
    """Write the files to a temporary directory, their checksums into meta.json, then rename it into place."""
    run_dir.mkdir(parents=True, exist_ok=True)
    final = run_dir / f"step-{step:06d}"
    if final.exists() or final.is_symlink():  # an earlier branch's checkpoint of this step: replaced only if ours
        if not owns(run_dir, final.name):
            raise CheckpointSaveError(f"cannot write checkpoint {final}: a {'link' if final.is_symlink() else 'file'} "
                                      "of that name is there that rlgraph did not write, and it never replaces one",
                                      fix=f"move {final} out of the run directory, then resume")
    tmp = Path(tempfile.mkdtemp(dir=run_dir, prefix=f".step-{step:06d}."))
    claim(run_dir, tmp.name)  # a crash leaves it recorded: the next prune removes it
    try:
        written = None if isinstance(state, ExecutorState) else state.write_state(str(tmp))
        if written is None:  # one process: the full form
            full = state if isinstance(state, ExecutorState) else state.export_state()
            written = {"roles": _write_full(tmp, full), "shuffle_rng": full.shuffle_rng, "sampling": full.sampling}
        roles = written["roles"]
        torch.save({"generator": written["shuffle_rng"], "sampling": dict(written["sampling"]), "extra": extra},
                   tmp / "run_state.pt")
        sha256 = {file.name: file_sha256(file) for file in sorted(tmp.iterdir())}
        _write_json_atomic(tmp / "meta.json", {"step": step, "versions": {r: v["version"] for r, v in roles.items()},
                                               "roles": roles, "sha256": sha256, "run_files": _run_files(run_dir)})
        (tmp / META_SUM).write_text(file_sha256(tmp / "meta.json") + "\n")
        follow_umask(tmp)  # mkdtemp and safetensors make 0700/0600: the run directory's one rule
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        claim(run_dir, final.name)
        release(run_dir, tmp.name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        release(run_dir, tmp.name)
        raise
    return final


def _run_files(run_dir: Path) -> dict[str, str]:
    """The files of the run directory a checkpoint depends on, by sha256: a LoRA run's base (hashed once,
    when written, into the manifest; hashed here only when the manifest has no record of it)."""
    base = run_dir / BASE_FILE
    if not base.is_file():
        return {}
    return {BASE_FILE: recorded_sha256(run_dir, BASE_FILE) or file_sha256(base)}


def claim_file(run_dir: Path, name: str) -> str:
    """Record `run_dir/name`, which rlgraph just wrote and reads back, in the manifest with its sha256."""
    digest = file_sha256(run_dir / name)
    claim(run_dir, name, sha256=digest)
    return digest


def _write_full(directory: Path, state: ExecutorState) -> dict[str, dict[str, Any]]:
    """Each role whole: `role.safetensors` and `role.optim.pt`; the roles as meta.json records them."""
    roles = {}
    for role, held in state.roles.items():
        save_file(untied({k: v.contiguous() for k, v in held.model.items()}), str(directory / f"{role}.safetensors"))
        if held.optimizer is not None:
            torch.save(dict(held.optimizer), directory / f"{role}.optim.pt")
        roles[role] = {"version": held.version, "optimizer": held.optimizer_kind}
    return roles


def prune_checkpoints(run_dir: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` `step-*` checkpoints (never the one `latest` names);
    returns the deleted paths. Leftover temporary directories of a crashed save go too."""
    run_dir = Path(run_dir)
    latest = latest_checkpoint(run_dir)
    entries = read_manifest(run_dir)
    steps = [path for path in checkpoint_dirs(run_dir) if owns(run_dir, path.name, entries)]
    doomed = [path for path in steps[: max(len(steps) - keep_last, 0)] if path != latest]
    doomed += [path for path in run_dir.glob(".step-*") if path.is_dir() and owns(run_dir, path.name, entries)]
    for path in doomed:
        remove_owned(run_dir, path)
    return doomed


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """The run's checkpoint directories, oldest first: `step-<digits>` real directories (a `step-best`
    copy, a `step-notes/` folder or a symbolic link is not one of them)."""
    found = [path for path in run_dir.glob("step-*") if _CHECKPOINT_NAME.fullmatch(path.name)
             and path.is_dir() and not path.is_symlink()]
    return sorted(found, key=lambda path: int(path.name.split("-")[1]))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint `run_dir/latest` points at; None when the run has none.

    A `latest` that cannot be read, or names no step-* directory of the run, is not trusted: it is
    written only after its checkpoint is complete, so the newest complete `step-*` directory (one
    with meta.json) is what it meant. That one is used, with a warning naming the file; with no such
    directory the run cannot be resumed and a ConfigError says how to start it again.
    """
    run_dir = Path(run_dir)
    pointer = run_dir / "latest"
    if not pointer.exists():
        return None
    problem = _pointer_problem(pointer, run_dir)
    if problem is None:
        path = run_dir / json.loads(pointer.read_text())["path"]
        if path.is_symlink():
            raise ConfigError(f"{pointer} names {path.name}, which is a symbolic link; rlgraph reads checkpoints only "
                              "from the directories it wrote", fix=f"replace the link {path} by the checkpoint "
                              "directory itself, or resume with --checkpoint naming another one")
        return path
    complete = [path for path in checkpoint_dirs(run_dir) if (path / "meta.json").is_file()]
    if not complete:
        raise ConfigError(f"{pointer} {problem}, and {run_dir} holds no complete step-* checkpoint to fall back on",
                          fix=f"delete {pointer} (and any step-* leftovers) to start the run afresh, or choose another run_dir")
    warnings.warn(f"{pointer} {problem}; using the newest complete checkpoint {complete[-1].name} instead", stacklevel=2)
    return complete[-1]


def _pointer_problem(pointer: Path, run_dir: Path) -> str | None:
    """What is wrong with a `latest` file (unreadable, not our JSON, or naming no step-* of the run), or None."""
    try:
        payload = json.loads(pointer.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        return f"cannot be read as JSON ({type(error).__name__})"
    name = payload.get("path") if isinstance(payload, dict) else None
    if not isinstance(name, str) or Path(name).name != name or not name.startswith("step-"):
        return f"does not name a step-* checkpoint of the run (it holds {str(payload)[:60]!r})"
    if not (run_dir / name).is_dir():
        return f"names {name}, which does not exist"
    return None


def _read(path: Path, load: Any, what: str) -> Any:
    """`load(path)`, or a `CheckpointMismatch` naming the file when it is missing, truncated or not
    what a checkpoint writes (never a raw JSON/zip/safetensors error)."""
    if not path.is_file():
        raise CheckpointMismatch(f"checkpoint file {path} is missing: the checkpoint is incomplete")
    try:
        return load(path)
    except Exception as error:  # noqa: BLE001 - truncated, random or hostile files alike
        detail = str(error).splitlines()[0][:200] if str(error) else ""
        raise CheckpointMismatch(f"checkpoint file {path} cannot be read as {what} ({type(error).__name__}: {detail}); "
                                 "it is truncated, corrupt or not a rlgraph checkpoint") from None


def _tensors(path: Path) -> Any:
    """`torch.load` with `weights_only=True`: tensors, numbers, strings and containers, never
    arbitrary objects (a pickle could run code)."""
    return torch.load(path, weights_only=True, map_location="cpu")


def _meta(path: Path) -> dict[str, Any]:
    """meta.json of checkpoint `path`, read only if its bytes are those meta.sha256 recorded, and its
    step the one the directory is named after."""
    if path.is_symlink():
        raise CheckpointMismatch(f"checkpoint {path} is a symbolic link; rlgraph writes checkpoints as directories "
                                 "and does not follow a link to read or delete one")
    recorded = _read(path / META_SUM, lambda file: file.read_text().strip(), "a checksum")
    if (path / "meta.json").is_file() and file_sha256(path / "meta.json") != recorded:
        raise CheckpointMismatch(f"checkpoint file {path / 'meta.json'} is damaged: its sha256 is not the one saved in "
                                 f"{path / META_SUM} (an edit, a flipped bit or a partial copy); it is not loaded")
    meta = _read(path / "meta.json", lambda file: json.loads(file.read_text()), "JSON")
    if not isinstance(meta, dict) or not isinstance(meta.get("versions"), dict) or "step" not in meta:
        raise CheckpointMismatch(f"checkpoint file {path / 'meta.json'} lacks 'step' or 'versions': not a rlgraph checkpoint")
    named = path.name.split("-")[1] if _CHECKPOINT_NAME.fullmatch(path.name) else None
    if named is not None and meta["step"] != int(named):
        raise CheckpointMismatch(f"checkpoint file {path / 'meta.json'} says step {meta['step']!r}, but the directory "
                                 f"is {path.name}: the checkpoint is damaged or was renamed")
    return meta


def _in_parts(meta: dict[str, Any]) -> bool:
    """Whether the checkpoint was written by its ranks, each role in parts (`rlgraph.backends.state_files`)."""
    return any(isinstance(held, dict) and "parts" in held for held in meta.get("roles", {}).values())


def read_checkpoint(path: str | Path) -> tuple[ExecutorState, int, dict[str, Any]]:
    """(state, step, extra) of the checkpoint in `path`, every file read and checked before anything is used.
    A checkpoint in parts is put together whole (any runtime, any rank count can load it)."""
    path = Path(path)
    meta = _meta(path)
    verify_checksums(path, meta)
    run_state = _read(path / "run_state.pt", _tensors, "the run state")
    if _in_parts(meta):
        try:
            state = full_state(path, meta["roles"], run_state["generator"], run_state["sampling"])
        except (OSError, KeyError, ValueError, RuntimeError) as error:
            raise CheckpointMismatch(f"checkpoint {path}: its parts cannot be read ({type(error).__name__}: "
                                     f"{str(error)[:200]}); it is incomplete or damaged") from None
        for role, held in state.roles.items():
            refuse_non_finite(held.model, role, f"checkpoint {path}")
        return state, meta["step"], run_state["extra"]
    roles = {}
    for role, version in meta["versions"].items():
        kind = meta.get("roles", {}).get(role, {}).get("optimizer")
        optim = path / f"{role}.optim.pt"
        optimizer = _read(optim, _tensors, "an optimizer state") if optim.exists() or kind else None
        if kind is None and optimizer is not None:  # written before the optimizer kind was recorded
            kind = "AdamW" if any("exp_avg" in s for s in optimizer.get("state", {}).values()) else "SGD"
        weights = _read(path / f"{role}.safetensors", lambda file: load_file(str(file)), "safetensors weights")
        refuse_non_finite(weights, role, f"checkpoint file {path / f'{role}.safetensors'}")
        roles[role] = RoleState(weights, optimizer, kind, version)
    return ExecutorState(roles, run_state["generator"], run_state["sampling"]), meta["step"], run_state["extra"]


def verify_checksums(path: Path, meta: dict[str, Any]) -> None:
    """Refuse a file of checkpoint `path` whose bytes are not those its save hashed into meta.json, and
    a run file it depends on (a LoRA run's base) that is not the one it was saved with. A meta.json
    without checksums is refused: verification is never turned off by deleting a key."""
    sha256 = meta.get("sha256")
    if sha256 is None:
        raise CheckpointMismatch(f"checkpoint file {path / 'meta.json'} has no 'sha256' checksums, so its files cannot "
                                 "be verified; it is not loaded (rlgraph writes them into every checkpoint)")
    if not isinstance(sha256, dict):
        raise CheckpointMismatch(f"checkpoint file {path / 'meta.json'}: 'sha256' is {str(sha256)[:60]!r}, not a "
                                 "mapping of file names to checksums; the checkpoint is damaged")
    for name, expected in sorted(sha256.items()):
        file = path / str(name)
        if Path(str(name)).name != name or not file.is_file():
            raise CheckpointMismatch(f"checkpoint file {file} is missing: the checkpoint is incomplete or damaged")
        if file_sha256(file) != expected:
            raise CheckpointMismatch(f"checkpoint file {file} is damaged: its sha256 is not the one recorded when it was "
                                     "saved (a flipped bit, a partial copy or an edit); it is not loaded")
    _verify_run_files(path, meta.get("run_files", {}))


def verify_checkpoint(path: str | Path) -> None:
    """Checkpoint `path`'s meta.json and the sha256 of every file it records (a LoRA base too), without
    loading a tensor: a damaged checkpoint is refused before any work is done for it."""
    path = Path(path)
    verify_checksums(path, _meta(path))


def _verify_run_files(path: Path, run_files: Any) -> None:
    """The run directory's files checkpoint `path` was saved with (a LoRA base), byte for byte."""
    if not isinstance(run_files, dict):
        raise CheckpointMismatch(f"checkpoint file {path / 'meta.json'}: 'run_files' is not a mapping; it is damaged")
    for name, expected in sorted(run_files.items()):
        file = path.parent / str(name)
        if Path(str(name)).name != name or not file.is_file():
            raise CheckpointMismatch(f"{file} is missing: checkpoint {path.name} was saved with it (a LoRA run's "
                                     "adapters apply to this base) and cannot be used without it")
        if file.is_symlink() or file_sha256(file) != expected:
            raise CheckpointMismatch(f"{file} is not the file checkpoint {path.name} was saved with: its sha256 differs "
                                     "(a flipped bit, a replaced or edited base); the checkpoint is not used with it")


def intact_checkpoint(path: Path) -> str | None:
    """None when checkpoint `path` reads whole (checksums, every file, finite weights), else what is wrong.
    A checkpoint in parts is checked one part file at a time, never put together."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            meta = _meta(path)
            if not _in_parts(meta):
                read_checkpoint(path)
                return None
            verify_checksums(path, meta)
            _read(path / "run_state.pt", _tensors, "the run state")
            for role, held in meta["roles"].items():
                _check_parts(path, role, held["parts"])
    except CheckpointMismatch as error:
        return str(error)
    return None


def _check_parts(path: Path, role: str, parts: int) -> None:
    try:
        check_parts(path, role, parts)
    except CheckpointMismatch:
        raise
    except Exception as error:  # noqa: BLE001 - a truncated or foreign part file
        raise CheckpointMismatch(f"checkpoint {path}: a part of role {role!r} cannot be read ({type(error).__name__}: "
                                 f"{str(error)[:200]}); it is incomplete or damaged") from None


def newest_intact(run_dir: Path, below: Path | None = None) -> Path | None:
    """The newest step-* checkpoint of `run_dir` (older than `below`, when given) that reads whole."""
    steps = [p for p in reversed(checkpoint_dirs(run_dir)) if below is None or _number(p) < _number(below)]
    return next((p for p in steps if intact_checkpoint(p) is None), None)


def read_extra(path: str | Path) -> dict[str, Any]:
    """The `extra` a checkpoint was saved with (run state only: no weights are read)."""
    return _read(Path(path) / "run_state.pt", _tensors, "the run state").get("extra", {})


def load_checkpoint(path: str | Path, executor: Any) -> dict[str, Any]:
    """Restore weights, optimizer states, versions and RNG into `executor` (or anything with
    `import_state`: an interpreter, a plan runner); returns `{"step": k, **extra}`. A checkpoint in
    parts loads into a runner rank by rank, each reading only its rows (`read_state`)."""
    path = Path(path)
    meta = _meta(path)
    if _in_parts(meta) and hasattr(executor, "read_state"):
        verify_checksums(path, meta)
        run_state = _read(path / "run_state.pt", _tensors, "the run state")
        executor.read_state(str(path), meta["roles"], run_state["generator"], run_state["sampling"],
                            where=f"checkpoint {path}")
        return {"step": meta["step"], **run_state["extra"]}
    state, step, extra = read_checkpoint(path)
    executor.import_state(state, where=f"checkpoint {path}")
    return {"step": step, **extra}


def load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor], path: Path, *, strict: bool) -> None:
    """Load `weights`, refusing names or shapes the model does not have (another model)."""
    expected = model.state_dict()
    unknown = sorted(set(weights) - set(expected))
    missing = sorted(set(expected) - set(weights)) if strict else []
    if strict:  # tied embeddings: the checkpoint holds both names, or the one the model keeps
        missing = [name for name in missing if not name.endswith("lm_head.weight")]
    bad = [name for name in weights if name in expected and tuple(weights[name].shape) != tuple(expected[name].shape)]
    if unknown or missing or bad:
        raise CheckpointMismatch(f"checkpoint {path} does not fit the run's model (unknown {unknown[:3]}, missing "
                                 f"{missing[:3]}, other shapes {bad[:3]}): was the model directory changed?")
    model.load_state_dict(weights, strict=False)


def _number(path: Path) -> int:
    return int(path.name.split("-")[1]) if _CHECKPOINT_NAME.fullmatch(path.name) else -1


def later_checkpoints(run_dir: Path, start: Path) -> list[Path]:
    """The checkpoints past `start` that a resume from it abandons (their branch is gone). Each must be
    one rlgraph wrote (recorded in its manifest, not a symbolic link): any other `step-<k>` past it is
    refused with a ConfigError before anything changed, since the resume would have to remove it."""
    if start.parent.resolve() != run_dir.resolve():
        return []
    entries, step = read_manifest(run_dir), _meta(start)["step"]  # `start` may be a copy named otherwise (step-best)
    later = sorted((p for p in run_dir.glob("step-*") if _CHECKPOINT_NAME.fullmatch(p.name) and _number(p) > step),
                   key=_number)
    foreign = [p for p in later if not owns(run_dir, p.name, entries)]
    if foreign:
        what = "a symbolic link" if foreign[0].is_symlink() else "not recorded in its manifest"
        raise ConfigError(f"--resume {run_dir} from {start.name}: {foreign[0]} is past it and rlgraph did not write it "
                          f"({what}); the resume would abandon that step, and rlgraph never deletes what it did not write",
                          fix=f"move {', '.join(p.name for p in foreign[:3])} out of {run_dir}, then resume")
    return later


def abandon_later_checkpoints(run_dir: Path, start: Path, later: list[Path] | None = None) -> list[Path]:
    """A resume from `start`, older than the run's newest checkpoints, abandons their branch: `latest`
    names `start` first (a crash then never resumes the abandoned branch), then the later step-*
    checkpoints (`later_checkpoints`, all rlgraph's) are deleted; returns them. Called once the
    resume has read and verified everything it uses."""
    later = later_checkpoints(run_dir, start) if later is None else later
    if not later:
        return []
    _write_json_atomic(run_dir / "latest", {"path": start.name, "step": _meta(start)["step"]})
    for path in later:
        remove_owned(run_dir, path)
    return later


def resolve_checkpoint(run_dir: Path, checkpoint: str | Path | None) -> Path:
    """The checkpoint `checkpoint` names: None (the latest), a step number, a step-* name of the run,
    or a path; a ConfigError listing the run's checkpoints when there is no such one."""
    if checkpoint is None:
        path = latest_checkpoint(run_dir)
        if path is None:
            raise ConfigError(f"{run_dir} has no checkpoint", fix="train the run for at least one step first")
        return path
    text = str(checkpoint).strip()
    candidates = [] if not text else [run_dir / f"step-{int(text):06d}"] if text.isdigit() else [run_dir / text, Path(text)]
    for path in candidates:
        if path.is_symlink():
            raise ConfigError(f"--checkpoint {text!r}: {path} is a symbolic link; rlgraph reads checkpoints only from the "
                              "directories it wrote", fix=f"copy the checkpoint into place instead of linking it, or "
                              "name one of the run's own checkpoints")
        if path.is_dir():
            return path
    have = [p.name for p in checkpoint_dirs(run_dir)]
    raise ConfigError(f"--checkpoint {text!r}: no such checkpoint in {run_dir}",
                      fix=f"one of {', '.join(have)} (or its step number)" if have else "the run has no checkpoints yet")


def resume_point(run_dir: Path, chosen: str | int | None) -> Path:
    """The checkpoint a resume starts from (`chosen`, or the latest), read whole first: a damaged one
    (checksum, unreadable file, non-finite weights) is refused, naming the newest intact one to pass
    with --checkpoint; there is no silent fallback, the user decides to lose the steps after it."""
    if chosen is None and latest_checkpoint(run_dir) is None:
        raise ConfigError(f"--resume {run_dir}: no checkpoint there (no 'latest' file)",
                          fix="start the run without --resume, or point at a run directory that has step-* checkpoints")
    path = resolve_checkpoint(run_dir, chosen)
    if path.parent.resolve() != run_dir.resolve():  # a resume continues this run's own history
        raise ConfigError(f"--checkpoint {chosen}: {path} is not a checkpoint of {run_dir}",
                          fix="name one of the run's step-* checkpoints (or its step number); to start from another "
                              "run's weights, export it and point model.path at the export")
    problem = intact_checkpoint(path)
    if problem is None:
        return path
    intact = newest_intact(run_dir, below=path)
    which = "the latest checkpoint" if chosen is None else f"--checkpoint {chosen}:"
    fix = (f"resume from the newest intact checkpoint: rlgraph train --resume {run_dir} --checkpoint {intact.name} "
           "(the later steps are trained again)" if intact is not None
           else "no intact checkpoint is left in the run: start a new run (model.path can point at an export)")
    raise ConfigError(f"--resume {run_dir}: {which} {path.name} is damaged: {problem}", fix=fix)


def refuse_foreign(run_dir: Path, overwrite: bool) -> None:
    """A fresh run writes only into a directory holding nothing but what rlgraph wrote (its manifest,
    `rlgraph.train.manifest`), unless `overwrite`. Never, even with `overwrite`: over an earlier run's
    checkpoints (resume it instead), or beside a `base.safetensors` rlgraph did not write (a LoRA run
    would start from it)."""
    if latest_checkpoint(run_dir) is not None:
        raise ConfigError(f"run directory {run_dir} already holds checkpoints",
                          fix=f"resume it (rlgraph train --resume {run_dir}), or choose another name/run_dir")
    base = run_dir / BASE_FILE
    if (base.exists() or base.is_symlink()) and not owns(run_dir, BASE_FILE):
        raise ConfigError(f"run directory {run_dir} holds a {BASE_FILE} rlgraph did not write (another run's LoRA base?); "
                          "a fresh run neither deletes it nor starts from it",
                          fix=f"move {base} away, or choose another run_dir")
    foreign = foreign_entries(run_dir)
    if foreign and not overwrite:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ConfigError(f"run directory {run_dir} holds files rlgraph did not write ({shown}); a fresh run there "
                          "would overwrite its config.yaml, metrics.jsonl and summary.json",
                          fix="choose another run_dir (or name), or pass --overwrite (overwrite: true) to write into it "
                              f"anyway: rlgraph then replaces only the names it writes, listed in {MANIFEST}")
