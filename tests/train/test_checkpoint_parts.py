"""Checkpoints in parts (`rlgraph.backends.state_files`): what spmd/Ray ranks write, each its own rows.

The writer here stands in for the ranks (tests/runtime/test_spmd.py writes them with 2 real FSDP2
ranks): a local executor's weights and AdamW state cut into torch.chunk rows, one file per part.
"""

from __future__ import annotations

import json

import pytest
import torch

import rlgraph as rg
from rlgraph.algorithms import grpo
from rlgraph.backends.local.state import CheckpointMismatch
from rlgraph.backends.state_files import chunk_rows, optimizer_file, part_file, read_rows, write_part
from rlgraph.runtime.plan_runner import PlanRunner
from rlgraph.testing import tiny_executor
from rlgraph.train.checkpoint import intact_checkpoint, load_checkpoint, read_checkpoint, save_checkpoint


class PartsWriter:
    """What a runner over `parts` FSDP2 ranks hands `save_checkpoint`: `write_state(directory)`."""

    def __init__(self, executor, parts: int, poison: str | None = None):
        self.state, self.parts, self.poison = executor.export_state(), parts, poison

    def write_state(self, directory: str) -> dict:
        from pathlib import Path

        roles = {}
        for role, held in self.state.roles.items():
            shapes = {name: tuple(value.shape) for name, value in held.model.items()}
            for part in range(self.parts):
                rows = {name: value[slice(*chunk_rows(value.shape[0], part, self.parts))].clone()
                        for name, value in held.model.items() if value.dim()}
                if self.poison in rows and rows[self.poison].numel():
                    rows[self.poison].view(-1)[0] = float("nan")
                write_part(Path(directory), role, part, self.parts, rows, {}, shapes)
                optimizer = {"state": {index: {key: value[slice(*chunk_rows(value.shape[0], part, self.parts))]
                                               if value.dim() else value for key, value in entries.items()}
                                       for index, entries in held.optimizer["state"].items()},
                             "param_groups": held.optimizer["param_groups"]}
                torch.save(optimizer, Path(directory) / optimizer_file(role, part, self.parts))
            roles[role] = {"version": held.version, "optimizer": held.optimizer_kind, "parts": self.parts}
        return {"roles": roles, "shuffle_rng": self.state.shuffle_rng, "sampling": self.state.sampling}


@pytest.mark.parametrize("parts", [1, 2, 3])
def test_parts_put_together_are_the_whole_state_and_load_anywhere(tmp_path, parts):
    saved = tiny_executor(optimizer="adamw", seed=1)
    path = save_checkpoint(tmp_path, 2, PartsWriter(saved, parts), {"note": 1})
    assert (path / part_file("policy", parts - 1, parts)).is_file() and not (path / "policy.safetensors").exists()
    assert json.loads((path / "meta.json").read_text())["roles"]["policy"]["parts"] == parts
    state, step, extra = read_checkpoint(path)
    expected = saved.export_state().roles["policy"]
    assert step == 2 and extra == {"note": 1}
    assert all(torch.equal(state.roles["policy"].model[name], value) for name, value in expected.model.items())
    for index, entries in expected.optimizer["state"].items():
        assert all(torch.equal(state.roles["policy"].optimizer["state"][index][key], value) for key, value in entries.items())
    assert intact_checkpoint(path) is None
    # into a fresh executor (put together whole), and through a plan runner's local transport (`read_state`)
    direct, through_runner = tiny_executor(optimizer="adamw", seed=5), tiny_executor(optimizer="adamw", seed=7)
    load_checkpoint(path, direct)
    load_checkpoint(path, PlanRunner(rg.compile(grpo, sizes={"B": 2, "P": 8, "T": 4}, n=2), through_runner))
    for target in (direct, through_runner):
        loaded = target.export_state().roles["policy"]
        assert all(torch.equal(loaded.model[name], value) for name, value in expected.model.items())
        assert loaded.version == expected.version


@pytest.mark.parametrize(("written", "read"), [(2, 4), (3, 2), (4, 1), (1, 3)])
def test_any_rank_count_reads_exactly_its_rows(tmp_path, written, read):
    saved = tiny_executor(optimizer="adamw", seed=1)
    path = save_checkpoint(tmp_path, 1, PartsWriter(saved, written), {})
    full = saved.export_state().roles["policy"].model
    for position in range(read):
        rows = read_rows(path, "policy", written, {name: chunk_rows(value.shape[0], position, read)
                                                   for name, value in full.items()})
        for name, value in full.items():
            chunks = torch.chunk(value, read)
            assert torch.equal(rows[name], chunks[position] if position < len(chunks) else value[:0])


def test_a_nan_in_one_part_is_refused_naming_the_file_and_tensor(tmp_path):
    saved = tiny_executor(optimizer="adamw", seed=1)
    name = next(iter(saved.export_state().roles["policy"].model))
    path = save_checkpoint(tmp_path, 1, PartsWriter(saved, 2, poison=name), {})  # checksums right, values not
    problem = intact_checkpoint(path)
    assert problem is not None and "policy.part-0-of-2.safetensors" in problem and repr(name) in problem
    with pytest.raises(CheckpointMismatch, match="non-finite"):
        read_checkpoint(path)
    target = tiny_executor(optimizer="adamw", seed=5)
    before = {k: v.clone() for k, v in target.models["policy"].model.state_dict().items()}
    with pytest.raises(CheckpointMismatch, match="non-finite"):
        load_checkpoint(path, target)
    assert all(torch.equal(before[k], v) for k, v in target.models["policy"].model.state_dict().items())


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove"])
def test_a_damaged_part_is_refused(tmp_path, damage):
    path = save_checkpoint(tmp_path, 1, PartsWriter(tiny_executor(optimizer="adamw", seed=1), 2), {})
    part = path / part_file("policy", 1, 2)
    data = bytearray(part.read_bytes())
    if damage == "flip":
        data[-3] ^= 0x10
        part.write_bytes(bytes(data))
    elif damage == "truncate":
        part.write_bytes(bytes(data[: len(data) // 2]))
    else:
        part.unlink()
    assert "policy.part-1-of-2.safetensors" in intact_checkpoint(path)
    with pytest.raises(CheckpointMismatch, match="part-1-of-2"):
        read_checkpoint(path)
