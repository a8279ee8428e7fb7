"""`model.teachers` (rlgraph/train/teachers.py): a teacher directory becomes one more frozen role of the
run, built by the same recipe on the local runtime and for the workers; a teacher of another
tokenizer, of too small a vocabulary, missing, unread or misnamed is refused before anything is built."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import rlgraph
from rlgraph.backends.local.models import build_causal_lm, load_tokenizer
from rlgraph.errors import ConfigError
from rlgraph.train.recipe import world_of_config
from rlgraph.train.run import dry_run
from rlgraph.train.setup import prepare
from tests.train.test_run import make_config

DISTILL = {"name": "distill", "hparams": {}}


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A teacher of the student's tokenizer: the tiny Qwen2 drawn with seed 3, saved with the tokenizer."""
    path = tmp_path_factory.mktemp("teacher")
    tokenizer = load_tokenizer()
    build_causal_lm(tokenizer=tokenizer, seed=3).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def distill_config(tmp_path, teacher, name="d", **sections):
    return make_config(tmp_path, name, algorithm=DISTILL, model={"teachers": {"teacher": str(teacher)}},
                       warm_start={"steps": 0}, **sections)[0]


def test_the_teacher_is_a_role_of_the_plan_and_of_the_workers_recipe(tmp_path, teacher_dir):
    setup = dry_run(distill_config(tmp_path, teacher_dir))
    text = setup.rl.as_text()
    assert "teacher   rank 0       infer dp=1" in text and "@teacher   logprobs=logprobs" in text
    assert "  teacher   infer" in text  # its memory, sized from its own config
    spec = world_of_config(setup).roles["teacher"]
    assert spec.source == str(teacher_dir.resolve()) and spec.optimizer is None  # frozen, from its directory


def test_a_teacher_with_another_tokenizer_is_refused_naming_both(tmp_path, teacher_dir):
    other = tmp_path / "other"
    shutil.copytree(teacher_dir, other)
    tokenizer = load_tokenizer()
    tokenizer.add_tokens(["<tool>"])
    tokenizer.save_pretrained(other)
    with pytest.raises(ConfigError, match=r"model.teachers.teacher .*other.* has another tokenizer than the "
                                          r"student's \(the shipped character tokenizer\): 48 vs 47 tokens"):
        prepare(distill_config(tmp_path, other))


def test_a_teacher_whose_vocabulary_misses_the_students_ids_is_refused(tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    config = json.loads((Path(rlgraph.__file__).parent / "assets" / "tiny_qwen2.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "vocab_size": 20}))
    with pytest.raises(ConfigError, match="vocab_size=20 is smaller than the student's tokenizer"):
        prepare(distill_config(tmp_path, small))


@pytest.mark.parametrize(("sections", "message"), [
    (dict(algorithm=DISTILL), "reads state.teacher, but model.teachers has no 'teacher'"),
    (dict(model={"teachers": {"teacher": "TEACHER"}}), "algorithm 'grpo' never reads state.teacher"),
    (dict(algorithm=DISTILL, model={"teachers": {"teacher": "/no/such/dir"}}), "'/no/such/dir' does not exist"),
    (dict(algorithm=DISTILL, model={"teachers": {"policy": "TEACHER"}}), "teacher role 'policy' must be a Python name"),
    (dict(algorithm=DISTILL, model={"teachers": {"my-teacher": "TEACHER"}}), "teacher role 'my-teacher'"),
])
def test_bad_teacher_configs_are_refused(tmp_path, teacher_dir, sections, message):
    if "model" in sections:
        teachers = {role: str(teacher_dir) if path == "TEACHER" else path for role, path in sections["model"]["teachers"].items()}
        sections = {**sections, "model": {"teachers": teachers}}
    with pytest.raises(ConfigError, match=message):
        prepare(make_config(tmp_path, "bad", warm_start={"steps": 0}, **sections)[0])
