"""A run's frozen teachers (`model.teachers`, for `distill` and `gkd`): one more model role each,
built by the same recipe as the reference, on every runtime.

    model: {path: runs/student, teachers: {teacher: runs/teacher}}

A teacher is a local Hugging Face directory (config.json and weights) or a config; it may have
another size than the student but must share its tokenizer: token ids are what the teacher scores.
A teacher directory with its own tokenizer.json is compared with the run's, vocabulary and special
tokens; without one it reads the run's ids, so its vocabulary must cover them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlgraph.ir import specs as S
from rlgraph.errors import ConfigError

# roles a teacher may not be named after: the run builds them from model.path
RESERVED = ("policy", "ref", "critic", "reward", "env", "rollout")


def teacher_roles(config: Any) -> dict[str, S.Spec]:
    """{role: its spec} for each configured teacher: the roles beyond the defaults an algorithm may read."""
    return {role: S.ModelSpec(role) for role in config.model.teachers}


def check_teacher_sources(config: Any, tokenizer: Any) -> None:
    """Each configured teacher exists and shares the run's tokenizer (before the plan sizes it)."""
    for role, path in config.model.teachers.items():
        _check_teacher(config, role, path, tokenizer)


def check_teachers_read(config: Any, read: set[str]) -> None:
    """Every teacher the plan reads (`read`: the model roles of the RL program) is configured, and
    every configured one is read."""
    teachers = config.model.teachers
    for role in sorted(read - {"policy", "ref", "critic"}):
        if role not in teachers:
            raise ConfigError(f"algorithm {config.algorithm.name!r} reads state.{role}, but model.teachers has no "
                              f"{role!r} (it has {', '.join(teachers) or 'none'})",
                              fix=f"model: {{teachers: {{{role}: path/to/teacher_model_dir}}}}")
    for role in teachers:
        if role not in read:
            raise ConfigError(f"model.teachers.{role}: algorithm {config.algorithm.name!r} never reads state.{role}",
                              fix="use algorithm.name: distill or gkd (hparams.teachers names the roles), or drop it")


def _check_teacher(config: Any, role: str, path: str, tokenizer: Any) -> None:
    from rlgraph.backends.local.models import load_tokenizer

    key, source = f"model.teachers.{role}", Path(path)
    if not source.exists():
        raise ConfigError(f"{key} {path!r} does not exist",
                          fix="point it at a Hugging Face model directory (config.json and safetensors weights)")
    if source.is_dir() and not (source / "config.json").is_file():
        raise ConfigError(f"{key} {path!r} is a directory without a config.json",
                          fix="point it at a directory written by model.save_pretrained(...)")
    student = config.model.tokenizer or config.model.path or "the shipped character tokenizer"
    if source.is_dir() and (source / "tokenizer.json").is_file():
        theirs = load_tokenizer(str(source))
        if theirs.get_vocab() != tokenizer.get_vocab() or theirs.all_special_tokens != tokenizer.all_special_tokens:
            raise ConfigError(f"{key} {path!r} has another tokenizer than the student's ({student}): "
                              f"{len(theirs)} vs {len(tokenizer)} tokens, and the teacher scores the student's token "
                              "ids", fix="distil from a teacher of the same tokenizer (same vocabulary and ids)")
    vocab = _vocab_size(source)
    if vocab is not None and vocab < len(tokenizer):
        raise ConfigError(f"{key} {path!r}: its vocab_size={vocab} is smaller than the student's tokenizer "
                          f"({student}, {len(tokenizer)} tokens)", fix="use a teacher of the student's tokenizer")


def _vocab_size(source: Path) -> int | None:
    import json

    file = source / "config.json" if source.is_dir() else source
    try:
        return int(json.loads(file.read_text()).get("vocab_size"))
    except (OSError, ValueError, TypeError):
        return None  # an unreadable config is reported by the model build, naming the file


def teacher_spec(config: Any, role: str) -> Any:
    """The worker recipe of teacher `role`: frozen, built from its directory (its own weights)."""
    from rlgraph.backends.world import RoleSpec

    return RoleSpec(source=str(Path(config.model.teachers[role]).resolve()), seed=config.train.seed)

