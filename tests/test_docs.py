"""The docs tell the truth about the command line and their code runs where a user runs it.

Every `rlgraph <command> --flag` written in README.md, docs/**/*.md or `rlgraph --help` (code
blocks and `inline code`) names a command that exists and flags its `--help` lists; the Python
blocks of docs/tutorials/*.md run top to bottom in a fresh process, from a temporary directory,
with only the `rlgraph` package importable (not this repository's `tests` or `examples`).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import rlgraph
from rlgraph import cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# Tutorials whose Python cannot run here, and why (each is checked another way).
NOT_RUN = {"train-your-model.md": "its one Python block downloads a model from the Hub; "
                                  "tests/train/test_tutorial.py checks its config and rewards"}


def documented_command_lines() -> list[tuple[str, str]]:
    """(where, command line) for each `rlgraph ...` in a code block or inline code of the docs."""
    found = []
    sources = [(path.relative_to(ROOT).as_posix(), path.read_text()) for path in DOCS]
    sources.append(("rlgraph --help", f"```\n{cli.__doc__}\n```"))
    for where, text in sources:
        for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
            block = block.replace("\\\n", " ")  # shell line continuations
            found += [(where, line.strip()) for line in block.splitlines() if line.strip().startswith("rlgraph ")]
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        found += [(where, " ".join(span.split())) for span in re.findall(r"`(rlgraph [^`]+)`", prose)]
    return found


def parse(line: str) -> tuple[list[str], str | None, list[str]]:
    """(flags before the command, the command or None for an error message / `rlgraph ...`, its flags)."""
    words = [word.strip("[]") for word in line.split("#")[0].split()[1:]]
    before = []
    while words and words[0].startswith("-"):
        before.append(words.pop(0))
    if not words or words[0] == "..." or words[0].endswith(":"):  # `rlgraph ...`, or quoted output `rlgraph plan: ...`
        return before, None, []
    flags = [word.split("=")[0] for word in words[1:] if re.fullmatch(r"-{1,2}[a-zA-Z][\w-]*(=.*)?", word)]
    return before, words[0], flags


def help_text(*argv: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli.main([*argv, "--help"])
    return out.getvalue()


def lists(help: str, flag: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help) is not None


def test_every_documented_command_and_flag_exists():
    lines = documented_command_lines()
    assert len(lines) > 40  # the parser above still finds the docs' commands
    commands = set(cli._parser()._subparsers._group_actions[0].choices)
    helps = {None: help_text()}
    wrong = []
    for where, line in lines:
        before, command, flags = parse(line)
        wrong += [f"{where}: `{line}`: rlgraph has no flag {flag}" for flag in before if not lists(helps[None], flag)]
        if command is None:
            continue
        if command not in commands:
            wrong.append(f"{where}: `{line}`: no command {command!r} (rlgraph has {', '.join(sorted(commands))})")
            continue
        if command not in helps:
            helps[command] = help_text(command)
        wrong += [f"{where}: `{line}`: rlgraph {command} --help lists no {flag}"
                  for flag in flags if not lists(helps[command], flag)]
    assert wrong == [], "\n".join(wrong)


def test_the_parser_reads_flags_commands_and_output():
    assert parse("rlgraph --debug plan grpo --mesh cpu:2 [--dot plan.dot] -p kl=1e-3  # why") == (
        ["--debug"], "plan", ["--mesh", "--dot", "-p"])
    assert parse("rlgraph plan: role 'policy' does not fit")[1] is None
    assert parse("rlgraph ... --import m")[1] is None
    assert not lists(help_text("demo"), "--dry-run") and lists(help_text("train"), "--dry-run")


@pytest.mark.slow  # a fresh interpreter and two training steps: about a minute on 2 cores
@pytest.mark.parametrize("tutorial", sorted(path.name for path in (ROOT / "docs" / "tutorials").glob("*.md")))
def test_the_tutorials_python_runs_from_outside_the_repository(tutorial, tmp_path):
    if tutorial in NOT_RUN:
        pytest.skip(NOT_RUN[tutorial])
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "tutorials" / tutorial).read_text(), re.S)
    assert blocks, f"{tutorial} has no Python block"
    only_rlgraph = tmp_path / "path"
    check = f"import rlgraph\nassert rlgraph.__file__.startswith({str(only_rlgraph)!r}), rlgraph.__file__\n"
    (tmp_path / "tutorial.py").write_text(check + "\n".join(blocks))
    only_rlgraph.mkdir()
    (only_rlgraph / "rlgraph").symlink_to(Path(rlgraph.__file__).parent)  # this checkout's package, nothing beside it
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(only_rlgraph)}
    result = subprocess.run([sys.executable, str(tmp_path / "tutorial.py")], cwd=work, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{tutorial}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"


def test_tinker_snippets_take_the_client_out_of_its_future():
    """The Tinker SDK's client-creation calls return futures; using one as the client is deprecated
    (a warning per attribute) and goes away in a later SDK: every doc snippet calls `.result()`."""
    creating = re.compile(r"\.(create_lora_training_client|create_training_client_from_state\w*|create_sampling_client|"
                          r"save_weights_and_get_sampling_client)\((.*)")
    bare = []
    for path in DOCS:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("|")[0] if line.startswith("|") else line  # table cells name the calls, not run them
            found = creating.search(code)
            if found and ".result()" not in found.group(2):
                bare.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not bare, "\n".join(bare)
