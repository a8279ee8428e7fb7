"""Atomic, exact-resume checkpoints.

A checkpoint is a directory `step-<k>/` holding every trainable role's weights (safetensors),
its optimizer state, the executor's shuffling RNG and sampling stream, the data sampler's
position and the run's counters. It is written to a temporary sibling and renamed into place, and `latest` is replaced
atomically after that, so a crash leaves either the old or the new checkpoint, never half of one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors.torch import load_file, save_file

from rlgraph.backends.local.executor import LocalExecutor
from rlgraph.backends.local.generation import SamplingStream


def _write_json_atomic(path: Path, payload: Any) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as handle:
        json.dump(payload, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def save_checkpoint(run_dir: str | Path, step: int, executor: LocalExecutor, extra: dict[str, Any]) -> Path:
    """Write `run_dir/step-<step>` atomically and point `run_dir/latest` at it."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    final = run_dir / f"step-{step:06d}"
    tmp = Path(tempfile.mkdtemp(dir=run_dir, prefix=f".step-{step:06d}."))
    try:
        versions = {}
        for role, worker in executor.models.items():
            state = {k: v.detach().contiguous() for k, v in worker.model.state_dict().items()}
            save_file(_untie(state), str(tmp / f"{role}.safetensors"))
            if worker.optimizer is not None:
                torch.save(worker.optimizer.state_dict(), tmp / f"{role}.optim.pt")
            versions[role] = worker.version
        torch.save({"generator": executor.generator.get_state(), "sampling": attrs.asdict(executor.sampling),
                    "extra": extra}, tmp / "run_state.pt")
        _write_json_atomic(tmp / "meta.json", {"step": step, "versions": versions})
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _write_json_atomic(run_dir / "latest", {"path": final.name, "step": step})
    return final


def _untie(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors sharing memory (tied embeddings): store independent copies."""
    seen: dict[int, str] = {}
    out = {}
    for key, value in state.items():
        ptr = value.data_ptr()
        out[key] = value.clone() if ptr in seen else value
        seen.setdefault(ptr, key)
    return out


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    pointer = Path(run_dir) / "latest"
    if not pointer.exists():
        return None
    return Path(run_dir) / json.loads(pointer.read_text())["path"]


def load_checkpoint(path: str | Path, executor: LocalExecutor) -> dict[str, Any]:
    """Restore weights, optimizer states, versions and RNG; returns `{"step": k, **extra}`."""
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    for role, worker in executor.models.items():
        if role not in meta["versions"]:
            raise ValueError(f"checkpoint {path} has no role {role!r}; it has {', '.join(meta['versions'])}")
        worker.model.load_state_dict(load_file(str(path / f"{role}.safetensors")), strict=True)
        if worker.optimizer is not None:
            worker.optimizer.load_state_dict(torch.load(path / f"{role}.optim.pt", weights_only=False))
        worker.version = meta["versions"][role]
    run_state = torch.load(path / "run_state.pt", weights_only=False)
    executor.generator.set_state(run_state["generator"])
    executor.sampling = SamplingStream(**run_state["sampling"])
    return {"step": meta["step"], **run_state["extra"]}
