"""Saved states on disk, under `--state-dir`, each owned by the API key that saved it.

    <state-dir>/<run>/owner.json               {"owner": <key digest>, "model_id": ...}
    <state-dir>/<run>/weights/<name>.pt        save_state: adapter + optimizer + counters
    <state-dir>/<run>/sampler_weights/<name>.pt  save_weights_for_sampler: adapter only

A path is Tinker's `tinker://<model_id>/weights/<name>`. Files are written to a temporary name
and renamed (a crash leaves the old state or the new one, never half of one), and read with
`torch.load(weights_only=True)`: tensors and plain data only, nothing is unpickled. A path of
another key reads as "not found", exactly like a missing one.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from rlgraph.service.errors import CallError, not_found
from rlgraph.service.tenants import check_name

KINDS = ("weights", "sampler_weights")
PATH = re.compile(r"^tinker://(?P<model>[^/]+)/(?P<kind>[a-z_]+)/(?P<name>[^/]+)$")


def tinker_path(model_id: str, kind: str, name: str) -> str:
    return f"tinker://{model_id}/{kind}/{name}"


class Store:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _run(self, model_id: str) -> Path:
        return self.root / model_id.replace(":", "_")

    def claim(self, model_id: str, owner: str) -> None:
        """Record that `owner` holds `model_id`'s saved states (once; a run never changes owner)."""
        run = self._run(model_id)
        run.mkdir(parents=True, exist_ok=True)
        marker = run / "owner.json"
        if not marker.exists():
            _write_atomic(marker, json.dumps({"owner": owner, "model_id": model_id}).encode())

    def owner(self, model_id: str) -> str | None:
        return self.owner_of_dir(self._run(model_id))

    def save(self, owner: str, model_id: str, kind: str, name: str, payload: dict[str, Any], *,
             overwrite: bool, max_states: int | None = None) -> str:
        """Write `payload` as `owner`'s state `name`; a new file past the key's `max_states` is refused."""
        check_name(name, "path")
        self.claim(model_id, owner)
        target = self._run(model_id) / kind / f"{name}.pt"
        if target.exists() and not overwrite:
            raise CallError(f"a state named {name!r} exists for this model", field="path", status=400,
                            fix="pick another name, or save_state(name, overwrite=True)")
        if max_states is not None and not target.exists() and self.count(owner) >= max_states:
            raise CallError(f"this API key holds {max_states} saved states, the server's limit (disk is shared)",
                            field="path", fix="overwrite an old name (overwrite=True), or ask the operator to "
                                              "remove old states from --state-dir")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".tmp")
        torch.save(payload, tmp)
        os.replace(tmp, target)
        return tinker_path(model_id, kind, name)

    def count(self, owner: str) -> int:
        """How many state files `owner`'s runs hold (read from disk: states survive restarts)."""
        return sum(len(list((run / kind).glob("*.pt"))) for run in self.root.iterdir()
                   if run.is_dir() and self.owner_of_dir(run) == owner for kind in KINDS)

    def owner_of_dir(self, run: Path) -> str | None:
        marker = run / "owner.json"
        return json.loads(marker.read_text())["owner"] if marker.is_file() else None

    def check(self, owner: str, path: object, field: str = "path", kinds: tuple[str, ...] = KINDS) -> Path:
        """The file of `path` if `owner` saved it; 404 otherwise (also for another key's path)."""
        match = PATH.match(path) if isinstance(path, str) else None
        if match is None or match["kind"] not in kinds:
            raise CallError(f"{path!r} is not a saved-state path of kind {' or '.join(kinds)}", field=field,
                            fix="pass the path save_state returned: tinker://<model_id>/weights/<name>")
        check_name(match["name"], field)
        target = self._run(match["model"]) / match["kind"] / f"{match['name']}.pt"
        if self.owner(match["model"]) != owner or not target.is_file():
            raise not_found("saved state", path, field)
        return target

    def load(self, owner: str, path: object, field: str = "path", kinds: tuple[str, ...] = KINDS) -> dict[str, Any]:
        """The payload at `path` if `owner` saved it (tensors and plain data only)."""
        return torch.load(self.check(owner, path, field, kinds), map_location="cpu", weights_only=True)


def _write_atomic(target: Path, data: bytes) -> None:
    tmp = target.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, target)
