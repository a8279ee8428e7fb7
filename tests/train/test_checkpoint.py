import errno
import json
import os
import warnings

import pytest

import torch

from rlgraph.algorithms import grpo
from rlgraph.data import arithmetic
from rlgraph.runtime.runner import EagerRunner
from rlgraph.train.checkpoint import latest_checkpoint
from rlgraph.train.loop import Trainer
from rlgraph.train.manifest import read_manifest
from tests.helpers import SPLITS, TOKENIZER, make_executor, params_of, parity_reward


def _trainer(run_dir):
    executor = make_executor(reward=parity_reward)
    sampler = arithmetic.PromptSampler(SPLITS.train, batch_size=3, seed=1)
    program = grpo.trace(n=2, max_new_tokens=3)
    return Trainer(EagerRunner(program, executor), lambda: arithmetic.to_prompts(sampler.next_batch(), TOKENIZER),
                   sampler, run_dir=run_dir, checkpoint_every=2), executor


def test_resume_continues_exactly(tmp_path):
    straight, straight_exec = _trainer(tmp_path / "a")
    list(straight.run(steps=4))

    first, _ = _trainer(tmp_path / "b")
    list(first.run(steps=3))  # checkpoint at step 2, then one step that is lost
    resumed, resumed_exec = _trainer(tmp_path / "b")
    assert resumed.resume() and resumed.step == 2
    list(resumed.run(steps=2))

    assert [m["reward"] for m in resumed.history] == [m["reward"] for m in straight.history]
    for a, b in zip(params_of(straight_exec), params_of(resumed_exec)):
        assert torch.equal(a, b)
    assert resumed_exec.models["policy"].version == 4


def test_checkpoints_are_complete_or_absent(tmp_path):
    trainer, _ = _trainer(tmp_path)
    list(trainer.run(steps=2))
    path = latest_checkpoint(tmp_path)
    assert path.name == "step-000002"
    assert {p.name for p in path.iterdir()} == {"policy.safetensors", "policy.optim.pt", "run_state.pt", "meta.json",
                                                "meta.sha256"}
    assert json.loads((path / "meta.json").read_text())["versions"] == {"policy": 2}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary leftovers


@pytest.mark.parametrize("damage", ["truncate policy.safetensors", "truncate policy.optim.pt", "truncate run_state.pt",
                                    "truncate meta.json", "remove policy.safetensors", "random run_state.pt"])
def test_a_damaged_checkpoint_is_refused_and_leaves_the_executor_as_it_was(damage, tmp_path):
    from rlgraph.backends.local.state import CheckpointMismatch
    from rlgraph.testing import tiny_executor
    from rlgraph.train.checkpoint import load_checkpoint, save_checkpoint

    saved = tiny_executor(optimizer="adamw", seed=1)
    path = save_checkpoint(tmp_path, 3, saved, {})
    action, name = damage.split()
    target = path / name
    if action == "truncate":
        target.write_bytes(target.read_bytes()[: len(target.read_bytes()) // 2])
    elif action == "remove":
        target.unlink()
    else:
        target.write_bytes(os.urandom(256))
    executor = tiny_executor(optimizer="adamw", seed=2)
    before = {k: v.clone() for k, v in executor.models["policy"].model.state_dict().items()}
    with pytest.raises(CheckpointMismatch, match=name.replace(".", r"\.")):
        load_checkpoint(path, executor)
    after = executor.models["policy"].model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before) and executor.current("policy").version == 0


def test_a_checkpoint_of_another_shape_or_optimizer_is_refused_before_anything_changes(tmp_path):
    from rlgraph.backends.local.state import CheckpointMismatch
    from rlgraph.testing import tiny_executor
    from rlgraph.train.checkpoint import load_checkpoint, save_checkpoint

    path = save_checkpoint(tmp_path, 1, tiny_executor(optimizer="sgd"), {})
    with pytest.raises(CheckpointMismatch, match="trained with SGD, this run uses AdamW"):
        load_checkpoint(path, tiny_executor(optimizer="adamw"))
    with pytest.raises(CheckpointMismatch, match="has no role 'critic'"):
        load_checkpoint(path, tiny_executor(roles=("policy", "critic")))


def _saved(tmp_path, step=3, **kwargs):
    from rlgraph.testing import tiny_executor
    from rlgraph.train.checkpoint import save_checkpoint

    return save_checkpoint(tmp_path, step, tiny_executor(optimizer="adamw", seed=1, **kwargs), {})


def test_a_flipped_bit_inside_tensor_data_is_refused_naming_the_file(tmp_path):
    from rlgraph.backends.local.state import CheckpointMismatch
    from rlgraph.train.checkpoint import read_checkpoint

    path = _saved(tmp_path)
    target = path / "policy.safetensors"
    data = bytearray(target.read_bytes())
    data[-7] ^= 0x04  # a bit of the last tensor's data: the header still parses, the file still loads
    target.write_bytes(bytes(data))
    with pytest.raises(CheckpointMismatch, match=r"policy\.safetensors is damaged: its sha256"):
        read_checkpoint(path)


@pytest.mark.parametrize("edit", ["sha256 key deleted", "sha256 key deleted, meta.sha256 rewritten", "step 3 -> 7",
                                  "meta.sha256 deleted"])
def test_meta_json_is_checksummed_an_edit_of_it_is_refused_not_warned(edit, tmp_path):
    from rlgraph.backends.local.state import CheckpointMismatch
    from rlgraph.train.checkpoint import file_sha256, intact_checkpoint, read_checkpoint

    path = _saved(tmp_path)
    meta = json.loads((path / "meta.json").read_text())
    assert set(meta["sha256"]) == {"policy.safetensors", "policy.optim.pt", "run_state.pt"}
    if edit == "meta.sha256 deleted":
        (path / "meta.sha256").unlink()
    else:
        if edit.startswith("sha256"):
            del meta["sha256"]
        else:
            meta["step"] = 7
        (path / "meta.json").write_text(json.dumps(meta))
    if edit.endswith("rewritten"):  # checksum and meta edited together: checks are still not turned off
        (path / "meta.sha256").write_text(file_sha256(path / "meta.json"))
    expected = {"sha256 key deleted": r"meta\.json is damaged", "step 3 -> 7": r"meta\.json is damaged",
                "sha256 key deleted, meta.sha256 rewritten": r"has no 'sha256' checksums",
                "meta.sha256 deleted": r"meta\.sha256 is missing"}[edit]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused, not a warning
        with pytest.raises(CheckpointMismatch, match=expected):
            read_checkpoint(path)
    assert intact_checkpoint(path) is not None


def test_a_step_count_that_disagrees_with_the_directory_is_refused(tmp_path):
    from rlgraph.backends.local.state import CheckpointMismatch
    from rlgraph.train.checkpoint import file_sha256, read_checkpoint

    path = _saved(tmp_path)
    meta = json.loads((path / "meta.json").read_text())
    meta["step"] = 7  # and its checksum made to match: the directory name still says 3
    (path / "meta.json").write_text(json.dumps(meta))
    (path / "meta.sha256").write_text(file_sha256(path / "meta.json"))
    with pytest.raises(CheckpointMismatch, match="says step 7, but the directory is step-000003"):
        read_checkpoint(path)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_are_refused_naming_the_role_tensor_and_file(value, tmp_path):
    from rlgraph.backends.local.state import CheckpointMismatch
    from rlgraph.testing import tiny_executor
    from rlgraph.train.checkpoint import load_checkpoint, save_checkpoint

    saved = tiny_executor(optimizer="adamw", seed=1)
    name, tensor = next((k, v) for k, v in saved.models["policy"].model.state_dict().items() if ".layers." in k)  # not tied
    with torch.no_grad():
        tensor.view(-1)[0] = value
    path = save_checkpoint(tmp_path, 1, saved, {})  # saved as is: the checksums are right, the values are not
    with pytest.raises(CheckpointMismatch, match=rf"policy\.safetensors: role 'policy' tensor '{name}' holds 1 non-finite"):
        load_checkpoint(path, tiny_executor(optimizer="adamw", seed=2))


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"),
                                   PermissionError(errno.EACCES, "Permission denied"),
                                   OSError(errno.EROFS, "Read-only file system")])
@pytest.mark.parametrize("where", ["weights", "meta", "latest"])
def test_a_failed_save_names_path_and_cause_and_keeps_the_previous_checkpoint(error, where, tmp_path, monkeypatch):
    import rlgraph.train.checkpoint as checkpoint
    from rlgraph.testing import tiny_executor
    from rlgraph.train.checkpoint import CheckpointSaveError, read_checkpoint, save_checkpoint

    first = save_checkpoint(tmp_path, 1, tiny_executor(optimizer="adamw", seed=1), {})
    calls = []

    def failing(*args, **kwargs):
        calls.append(args)
        if where == "latest" and len(calls) == 1:  # meta.json's fsync passes, the one of `latest` fails
            return checkpoint_os.fsync(*args)
        error.filename = args[1] if where == "weights" else None
        raise error

    checkpoint_os = checkpoint.os

    if where == "weights":  # the first file of the checkpoint
        monkeypatch.setattr(checkpoint, "save_file", failing)
    else:  # the last one (meta.json, after the weights were written) or `latest` once the directory is in place
        monkeypatch.setattr(checkpoint, "os", _Patched(checkpoint.os, failing))
    with pytest.raises(CheckpointSaveError) as raised:
        save_checkpoint(tmp_path, 2, tiny_executor(optimizer="adamw", seed=3), {})
    text = str(raised.value)
    assert errno.errorcode[error.errno] in text and "fix:" in text and str(tmp_path) in text
    if where == "weights":
        assert "policy.safetensors" in text
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "rlgraph-manifest.json", "step-000001"]  # no leftovers
    assert read_manifest(tmp_path).keys() == {"latest", "step-000001"}
    assert latest_checkpoint(tmp_path) == first and read_checkpoint(first)[1] == 1


class _Patched:
    """`os` with one function (fsync) replaced: the meta.json write fails after the weights were written."""

    def __init__(self, module, fsync):
        self._module, self.fsync = module, fsync

    def __getattr__(self, name):
        return getattr(self._module, name)


def _saved_steps(run_dir, steps=(1, 2, 3)):
    from rlgraph.testing import tiny_executor
    from rlgraph.train.checkpoint import save_checkpoint

    executor = tiny_executor(optimizer="adamw", seed=1)
    return [save_checkpoint(run_dir, step, executor, {}) for step in steps]


def _user_files(run_dir):
    """What a user keeps in a run directory: a copy of a checkpoint and a notes folder (issue 34, item 10)."""
    import shutil

    shutil.copytree(run_dir / "step-000002", run_dir / "step-best")
    (run_dir / "step-notes").mkdir()
    (run_dir / "step-notes" / "todo.txt").write_text("compare with step-best")


def test_pruning_and_abandoning_delete_only_checkpoints_rlgraph_wrote(tmp_path):
    from rlgraph.train.checkpoint import abandon_later_checkpoints, prune_checkpoints

    _saved_steps(tmp_path)
    _user_files(tmp_path)
    assert [p.name for p in prune_checkpoints(tmp_path, keep_last=2)] == ["step-000001"]  # step-best is not "newer"
    gone = abandon_later_checkpoints(tmp_path, tmp_path / "step-000002")
    assert [p.name for p in gone] == ["step-000003"] and latest_checkpoint(tmp_path).name == "step-000002"
    assert (tmp_path / "step-best" / "meta.json").is_file() and (tmp_path / "step-notes" / "todo.txt").is_file()
    assert set(read_manifest(tmp_path)) == {"latest", "step-000002"}


@pytest.mark.parametrize("kind", ["symlink", "copy"])
def test_a_later_checkpoint_rlgraph_did_not_write_refuses_the_resume_before_latest_changes(kind, tmp_path):
    import shutil

    from rlgraph.errors import ConfigError
    from rlgraph.train.checkpoint import abandon_later_checkpoints

    _saved_steps(tmp_path, (1, 2))
    elsewhere = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    shutil.copytree(tmp_path / "step-000002", elsewhere)
    if kind == "symlink":
        (tmp_path / "step-000005").symlink_to(elsewhere, target_is_directory=True)
    else:
        shutil.copytree(elsewhere, tmp_path / "step-000005")
    latest_before = (tmp_path / "latest").read_text()
    with pytest.raises(ConfigError, match=r"step-000005 is past it and rlgraph did not write it"):
        abandon_later_checkpoints(tmp_path, tmp_path / "step-000001")
    assert (tmp_path / "latest").read_text() == latest_before  # nothing rewritten
    assert (tmp_path / "step-000002").is_dir() and (tmp_path / "step-000005" / "meta.json").is_file()


def test_a_symlinked_checkpoint_is_refused_with_a_message(tmp_path):
    import shutil

    from rlgraph.backends.local.state import CheckpointMismatch
    from rlgraph.errors import ConfigError
    from rlgraph.train.checkpoint import read_checkpoint, resolve_checkpoint

    _saved_steps(tmp_path / "run", (1,))
    shutil.copytree(tmp_path / "run" / "step-000001", tmp_path / "real")
    (tmp_path / "run" / "step-000002").symlink_to(tmp_path / "real", target_is_directory=True)
    with pytest.raises(ConfigError, match="step-000002 is a symbolic link"):
        resolve_checkpoint(tmp_path / "run", "2")
    (tmp_path / "run" / "latest").write_text(json.dumps({"path": "step-000002", "step": 2}))
    with pytest.raises(ConfigError, match="names step-000002, which is a symbolic link"):
        latest_checkpoint(tmp_path / "run")
    with pytest.raises(CheckpointMismatch, match="is a symbolic link"):
        read_checkpoint(tmp_path / "run" / "step-000002")


def test_a_save_never_replaces_a_checkpoint_directory_rlgraph_did_not_write(tmp_path):
    from rlgraph.testing import tiny_executor
    from rlgraph.train.checkpoint import CheckpointSaveError, save_checkpoint

    (tmp_path / "step-000004").mkdir()
    (tmp_path / "step-000004" / "mine.txt").write_text("the user's")
    with pytest.raises(CheckpointSaveError, match="rlgraph did not write, and it never replaces one"):
        save_checkpoint(tmp_path, 4, tiny_executor(optimizer="adamw", seed=1), {})
    assert (tmp_path / "step-000004" / "mine.txt").read_text() == "the user's"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".step")]
