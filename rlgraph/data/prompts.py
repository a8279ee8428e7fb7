"""Prompt data for `rlgraph train`: read a file of rows, render each prompt, batch them.

    rows, report = load_prompts("train.jsonl", tokenizer, prompt_field="question", max_prompt_tokens=256)
    log(report.summary())            # train.jsonl: kept 997 of 1000 rows; dropped 3 (prompt longer than 256 tokens)
    prompts = to_prompts(rows[:8], tokenizer)   # ids i64[8,P] left-padded, meta {"answer", "text", extras}

Rows come from JSON lines (or a JSON array), CSV, Parquet or a `datasets.save_to_disk` directory.
A bad row stops the run with its file and line (`DataError`): a silently skipped or misread row
would change what the policy trains on without anyone noticing. Empty and over-long prompts are
the exception: they are dropped and counted in the `DataReport`, because real data sets have a
few and the right response is to log them, not to refuse the file.
"""

from __future__ import annotations

import csv
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from transformers import PreTrainedTokenizerBase

from rlgraph.batches import Prompts, Rollouts
from rlgraph.errors import ConfigError, did_you_mean

SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".csv": "csv"}
FORMATS = ("auto", "jsonl", "json", "csv", "parquet", "datasets")
# Meta keys that rlgraph itself fills (and that reward functions receive by name): no extra field may take them.
RESERVED_FIELDS = ("answer", "text", "completions")
EMPTY = "empty prompt"


class DataError(ConfigError):
    """A data file or row is unusable: the message names the file, the row (1-based line for JSON
    lines and CSV) and the field; `fix` says what to change. An `RLGraphError` and a ValueError;
    a `ConfigError` because the data is named by the run's config (`data.train`)."""


@attrs.frozen
class PromptRow:
    """One usable prompt. `text` is exactly what the tokenizer sees (after the chat template)."""

    text: str
    answer: Any | None
    fields: Mapping[str, Any]
    source: str  # "file.jsonl:17", "file.parquet row 3": where to look when this row misbehaves


@attrs.frozen
class DataReport:
    """What `load_prompts` kept of a file, and why it dropped the rest (reason -> count)."""

    path: str
    total: int
    kept: int
    dropped: Mapping[str, int] = attrs.field(converter=dict)

    def summary(self) -> str:
        line = f"{self.path}: kept {self.kept} of {self.total} rows"
        if self.dropped:
            line += "; dropped " + ", ".join(f"{count} ({reason})" for reason, count in self.dropped.items())
        return line


# ---- reading records ---------------------------------------------------------------------------

def read_records(path: str | Path, *, format: str = "auto", split: str | None = None) -> list[dict[str, Any]]:
    """Every row of `path` as a dict, in file order.

    `format="auto"` goes by the suffix (.jsonl/.json: JSON lines or a JSON array; .csv; .parquet)
    and reads a directory as a `datasets.save_to_disk` output; `split` picks one split of a saved
    `DatasetDict` and is refused for anything else (it would otherwise be silently ignored).
    """
    return [record for _, record in _read_sourced(path, format, split)]


def _read_sourced(path: str | Path, format: str, split: str | None) -> list[tuple[str, dict[str, Any]]]:
    """(source, record) pairs; `source` is the location that error messages cite."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such file or directory", fix="check the path (relative paths start at the "
                        f"working directory, {Path.cwd()})")
    kind = _format_of(path, format)
    if split is not None and kind != "datasets":
        raise DataError(f"{path}: split={split!r} only applies to a `datasets.save_to_disk` directory, and this is "
                        f"a {kind} file", fix="remove the split, or point at the saved dataset directory")
    readers = {"jsonl": _read_json, "csv": _read_csv, "parquet": _read_parquet}
    records = _read_datasets(path, split) if kind == "datasets" else readers[kind](path)
    if not records:
        raise DataError(f"{path}: the file holds no rows", fix="point at a file with at least one row")
    return records


def _format_of(path: Path, format: str) -> str:
    if format not in FORMATS:
        raise DataError(f"{path}: unknown format {format!r}{did_you_mean(format, FORMATS)}",
                        fix=f"use one of {', '.join(FORMATS)}")
    if format == "json":
        format = "jsonl"
    if path.is_dir():
        if format not in ("auto", "datasets"):
            raise DataError(f"{path}: is a directory, so format={format!r} cannot read it",
                            fix="use format 'auto' or 'datasets' for a `save_to_disk` directory, or name a file")
        return "datasets"
    if format != "auto":
        return format
    kind = SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise DataError(f"{path}: cannot tell the format from the suffix {path.suffix or '(none)'!r}",
                        fix=f"use a file ending in {', '.join(SUFFIXES)}, a `datasets.save_to_disk` directory, "
                            f"or set the format explicitly ({', '.join(FORMATS[1:])})")
    return kind


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise DataError(f"{path}: not UTF-8 text (byte {error.start}: {error.reason})",
                        fix="save the file as UTF-8") from None


def _read_json(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """JSON lines (blank lines skipped) or, when the file starts with `[`, one JSON array of objects."""
    text = _read_text(path)
    if text.lstrip().startswith("["):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as error:
            raise DataError(f"{path}:{error.lineno}: not valid JSON ({error.msg}, column {error.colno})",
                            fix="fix the JSON array, or write one JSON object per line") from None
        return [(f"{path} row {n}", _as_record(value, f"{path} row {n}")) for n, value in enumerate(values, 1)]
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        value = json_line(line, f"{path}:{number}")
        records.append((f"{path}:{number}", _as_record(value, f"{path}:{number}")))
    return records


def json_line(line: str, where: str) -> Any:
    """One line of a JSON-lines file, parsed; a bad line is a DataError citing `where` (file:line)."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as error:
        raise DataError(f"{where}: not valid JSON ({error.msg}, column {error.colno}): {line[:80]!r}",
                        fix="write one complete JSON object per line (JSON lines), or a JSON array") from None


def _as_record(value: Any, source: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise DataError(f"{source}: expected a JSON object of fields ({{\"prompt\": ...}}), got "
                        f"{type(value).__name__} {str(value)[:60]!r}", fix="make every row a JSON object")
    return value


def _read_csv(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """CSV with a header row; every value is a string. Each row's source is the line it ends on."""
    with path.open(newline="", encoding="utf-8") as file:
        reader = csv.DictReader(file)
        try:
            header = reader.fieldnames
            if header is not None and len(set(header)) != len(header):
                repeated = sorted({name for name in header if header.count(name) > 1})
                raise DataError(f"{path}:1: the header repeats column(s) {repeated}", fix="give every column its own name")
            records = []
            for row in reader:
                source = f"{path}:{reader.line_num}"
                if None in row or None in row.values():  # DictReader's marks of too many / too few values
                    count = len(header) + len(row[None]) if None in row else sum(v is not None for v in row.values())
                    raise DataError(f"{source}: the row has {count} values but the header has {len(header)} "
                                    f"columns ({', '.join(header)})",
                                    fix="quote values that contain commas, and give every row one value per column")
                records.append((source, dict(row)))
        except (csv.Error, UnicodeDecodeError) as error:
            raise DataError(f"{path}:{reader.line_num}: not readable as CSV ({error})",
                            fix="save the file as UTF-8 CSV with a header row") from None
    return records


def _read_parquet(path: Path) -> list[tuple[str, dict[str, Any]]]:
    import pyarrow
    import pyarrow.parquet

    try:
        rows = pyarrow.parquet.read_table(path).to_pylist()
    except (pyarrow.ArrowException, OSError) as error:
        raise DataError(f"{path}: not a readable Parquet file ({error})",
                        fix="write it with pyarrow.parquet.write_table or pandas.DataFrame.to_parquet") from None
    return [(f"{path} row {n}", row) for n, row in enumerate(rows, 1)]


def _read_datasets(path: Path, split: str | None) -> list[tuple[str, dict[str, Any]]]:
    import datasets  # imported here: it is slow to import and only this format needs it

    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError as error:
        raise DataError(f"{path}: not a directory written by `datasets` save_to_disk ({error})",
                        fix="save it with Dataset.save_to_disk(path), or point at a .jsonl/.csv/.parquet file") from None
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded)
        if split not in loaded:
            what = "has several splits" if split is None else f"has no split {split!r}{did_you_mean(split, splits)}"
            raise DataError(f"{path}: the saved DatasetDict {what}; its splits are {splits}",
                            fix=f"set the split to one of {splits}")
        loaded, where = loaded[split], f"{path}[{split}]"
    elif split is not None:
        raise DataError(f"{path}: split={split!r} given, but the saved dataset has no splits",
                        fix="remove the split")
    else:
        where = str(path)
    return [(f"{where} row {n}", row) for n, row in enumerate(loaded.to_list(), 1)]


# ---- rows to prompts ---------------------------------------------------------------------------

def load_prompts(path: str | Path, tokenizer: PreTrainedTokenizerBase, *, prompt_field: str = "prompt",
                 answer_field: str | None = "answer", extra_fields: Sequence[str] = (),
                 chat_template: bool | str = "auto", system_prompt: str | None = None,
                 max_prompt_tokens: int | None = None, format: str = "auto",
                 split: str | None = None) -> tuple[list[PromptRow], DataReport]:
    """The usable prompts of `path` and a report of what was dropped.

    `prompt_field` holds a string or chat messages `[{"role": ..., "content": ...}]`. The chat
    template (`"auto"`: the tokenizer's when it has one; `True`: require it; `False`: raw strings;
    any other string: that Jinja template) renders it with the generation prompt appended, after
    `system_prompt` as a first system message. Empty prompts (and null ones) and prompts longer than
    `max_prompt_tokens` tokens after the template are dropped and counted; a missing field is an error.
    """
    extra = _check_options(path, prompt_field, answer_field, extra_fields, max_prompt_tokens)
    template = _template_of(path, tokenizer, chat_template, system_prompt)
    records = _read_sourced(path, format, split)
    fields = [(prompt_field, "prompt_field")] + ([(answer_field, "answer_field")] if answer_field else [])
    fields += [(name, "extra_fields") for name in extra]
    rows, dropped = [], Counter()
    for source, record in records:
        _require_fields(record, fields, source)
        messages = _messages(record[prompt_field], source, prompt_field, template is not None, system_prompt)
        if messages is None:
            dropped[EMPTY] += 1
            continue
        text = messages if template is None else _render(tokenizer, messages, template, source)
        rows.append(PromptRow(text, record[answer_field] if answer_field else None,
                              {name: record[name] for name in extra}, source))
    if max_prompt_tokens is not None and rows:
        lengths = [len(ids) for ids in encode_texts([row.text for row in rows], tokenizer)]
        too_long = f"prompt longer than {max_prompt_tokens} tokens"
        if any(length > max_prompt_tokens for length in lengths):
            dropped[too_long] = sum(length > max_prompt_tokens for length in lengths)
            rows = [row for row, length in zip(rows, lengths) if length <= max_prompt_tokens]
    report = DataReport(str(path), len(records), len(rows), dict(dropped.most_common()))
    if not rows:
        raise DataError(f"{path}: none of its {len(records)} rows is usable: "
                        + ", ".join(f"{count} dropped as {reason}" for reason, count in report.dropped.items()),
                        fix="raise max_prompt_tokens, or check prompt_field points at the prompt text")
    return rows, report


def _check_options(path: str | Path, prompt_field: Any, answer_field: Any, extra_fields: Any,
                   max_prompt_tokens: Any) -> tuple[str, ...]:
    """Refuse bad option values before reading a file; returns the extra fields as a tuple."""
    def field_name(value: Any, option: str) -> None:
        if not isinstance(value, str) or not value:
            raise DataError(f"{path}: {option} must be a field name (a non-empty string), got {value!r}")

    field_name(prompt_field, "prompt_field")
    if answer_field is not None:
        field_name(answer_field, "answer_field")
    if isinstance(extra_fields, str) or not isinstance(extra_fields, Sequence):
        raise DataError(f"{path}: extra_fields must be a list of field names, got {extra_fields!r}",
                        fix=f"write extra_fields=[{extra_fields!r}]" if isinstance(extra_fields, str) else None)
    for name in extra_fields:
        field_name(name, "each of extra_fields")
        if name in RESERVED_FIELDS or extra_fields.count(name) > 1:
            why = "is listed twice" if name not in RESERVED_FIELDS else \
                f"is a name rlgraph fills itself ({', '.join(RESERVED_FIELDS)})"
            raise DataError(f"{path}: extra field {name!r} {why}",
                            fix="list each extra field once; read the answer with answer_field")
    if max_prompt_tokens is not None and (isinstance(max_prompt_tokens, bool) or not isinstance(max_prompt_tokens, int)
                                          or max_prompt_tokens < 1):
        raise DataError(f"{path}: max_prompt_tokens must be a positive integer or None, got {max_prompt_tokens!r}")
    return tuple(extra_fields)


def _template_of(path: str | Path, tokenizer: PreTrainedTokenizerBase, chat_template: Any,
                 system_prompt: Any) -> str | None:
    """None for raw strings, "" for the tokenizer's own chat template, else a Jinja template."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise DataError(f"{path}: system_prompt must be a string or None, got {system_prompt!r}")
    if chat_template is True and not has_template:
        raise DataError(f"{path}: chat_template is true but the tokenizer has no chat template",
                        fix="use a chat model's tokenizer, give the template as a string, or set chat_template false")
    if isinstance(chat_template, str) and chat_template != "auto":
        if "{{" not in chat_template and "{%" not in chat_template:
            raise DataError(f"{path}: chat_template must be 'auto', true, false or a Jinja template, "
                            f"got {chat_template!r}")
        return chat_template
    if not isinstance(chat_template, bool) and chat_template != "auto":
        raise DataError(f"{path}: chat_template must be 'auto', true, false or a Jinja template, got {chat_template!r}")
    use = chat_template is True or (chat_template == "auto" and has_template)
    if system_prompt is not None and not use:
        why = "chat_template is false" if chat_template is False else "the tokenizer has no chat template"
        raise DataError(f"{path}: system_prompt needs a chat template, but {why}",
                        fix="drop system_prompt and write it into the prompts, or use a tokenizer with a chat template")
    return "" if use else None


def _require_fields(record: Mapping[str, Any], fields: Sequence[tuple[str, str]], source: str) -> None:
    for name, option in fields:
        if name not in record:
            undo = " (or answer_field=None for prompts without answers)" if option == "answer_field" else ""
            raise DataError(f"{source}: field {name!r} is missing; the row has fields {sorted(record)}"
                            f"{did_you_mean(name, record)}", fix=f"set {option} to a field the rows have{undo}, or fix the row")


def _messages(value: Any, source: str, field: str, templated: bool, system_prompt: str | None) -> Any:
    """The prompt as chat messages (or the raw string when untemplated); None when it is empty."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        if not templated:
            return value
        messages = [{"role": "user", "content": value}]
    elif isinstance(value, list) and all(isinstance(m, dict) for m in value):
        for number, message in enumerate(value, 1):
            if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
                raise DataError(f"{source}: field {field!r} message {number} needs string 'role' and 'content', "
                                f"got {message!r}", fix='write messages as {"role": "user", "content": "..."}')
        if not templated:
            raise DataError(f"{source}: field {field!r} holds chat messages but no chat template is applied",
                            fix="set chat_template to 'auto' or true with a chat tokenizer, or store prompts as strings")
        if not any(message["content"].strip() for message in value):
            return None
        messages = list(value)
    else:
        raise DataError(f"{source}: field {field!r} must be a string or a list of chat messages, got "
                        f"{type(value).__name__} {str(value)[:60]!r}", fix="point prompt_field at the prompt text")
    if system_prompt is not None:
        if messages[0]["role"] == "system":
            raise DataError(f"{source}: the row has its own system message and system_prompt is set too",
                            fix="drop system_prompt, or the system messages from the data")
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], template: str, source: str) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             chat_template=template or None)
    except Exception as error:  # jinja2 raises several types; any of them means this row did not render
        raise DataError(f"{source}: the chat template failed on this row ({type(error).__name__}: {error})",
                        fix="check the template and the row's messages") from error


def split_holdout(rows: Sequence[PromptRow], fraction: float, *, seed: int) -> tuple[list[PromptRow], list[PromptRow]]:
    """(train, holdout): a seeded `fraction` of the rows held out (at least one when fraction > 0),
    both lists in the original row order. Same rows, fraction and seed: same split."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction < 1:
        raise DataError(f"split_holdout: fraction must be a number in [0, 1), got {fraction!r}",
                        fix="hold out e.g. 0.05 of the rows, or 0 for none")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise DataError(f"split_holdout: seed must be an integer, got {seed!r}")
    count = max(1, round(fraction * len(rows))) if fraction > 0 else 0
    if count >= len(rows):
        raise DataError(f"split_holdout: holding out {fraction} of {len(rows)} rows ({count}) leaves none to train on",
                        fix="lower the fraction or add rows")
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    held = set(order[:count])
    return ([row for i, row in enumerate(rows) if i not in held], [row for i, row in enumerate(rows) if i in held])


# ---- tokenising and padding (shared with rlgraph.data.arithmetic) ------------------------------

def encode_texts(texts: Sequence[str], tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """Each prompt's token ids as the model sees them: with the tokenizer's special tokens (BOS),
    except for a text that already starts with the BOS token, as chat templates that write it do,
    so no prompt starts with two BOS tokens."""
    bos = tokenizer.bos_token
    starts = [bool(bos) and text.startswith(bos) for text in texts]
    encoded: list[list[int]] = [[] for _ in texts]
    for written in (False, True):
        index = [i for i, start in enumerate(starts) if start == written]
        if index:
            ids = tokenizer([texts[i] for i in index], add_special_tokens=not written)["input_ids"]
            for i, row in zip(index, ids):
                encoded[i] = list(row)
    return encoded


def encode_prompts(texts: Sequence[str], tokenizer: PreTrainedTokenizerBase) -> tuple[torch.Tensor, torch.Tensor]:
    """ids i64[B,P] left-padded with the pad id, mask bool[B,P] True on the tokens."""
    _need_tokens(tokenizer, "pad_token_id", "prompts")
    sequences = encode_texts(texts, tokenizer)
    width = max(len(ids) for ids in sequences)
    ids = torch.full((len(sequences), width), tokenizer.pad_token_id, dtype=torch.long)  # [B, P]
    mask = torch.zeros(len(sequences), width, dtype=torch.bool)  # [B, P]
    for row, tokens in enumerate(sequences):
        if tokens:
            ids[row, width - len(tokens) :] = torch.tensor(tokens)
            mask[row, width - len(tokens) :] = True
    return ids, mask


def encode_responses(answers: Sequence[str], tokenizer: PreTrainedTokenizerBase) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced responses: each answer's tokens then EOS, right-padded: ids i64[B,T], mask bool[B,T]."""
    _need_tokens(tokenizer, "pad_token_id", "demonstrations")
    _need_tokens(tokenizer, "eos_token_id", "demonstrations")
    sequences = [[*ids, tokenizer.eos_token_id] for ids in tokenizer(list(answers), add_special_tokens=False)["input_ids"]]
    steps = max(len(ids) for ids in sequences)
    response = torch.full((len(sequences), steps), tokenizer.pad_token_id, dtype=torch.long)  # [B, T]
    mask = torch.zeros(len(sequences), steps, dtype=torch.bool)  # [B, T]
    for row, tokens in enumerate(sequences):
        response[row, : len(tokens)] = torch.tensor(tokens)
        mask[row, : len(tokens)] = True
    return response, mask


def _need_tokens(tokenizer: PreTrainedTokenizerBase, attribute: str, what: str) -> None:
    if getattr(tokenizer, attribute) is None:
        raise DataError(f"the tokenizer has no {attribute.removesuffix('_id').replace('_', ' ')}, needed to batch {what}",
                        fix="set tokenizer.pad_token = tokenizer.eos_token (or add the token) before batching")


def to_prompts(rows: Sequence[PromptRow], tokenizer: PreTrainedTokenizerBase) -> Prompts:
    """Left-padded prompts with meta {"answer": [...], "text": [...], and one list per extra field}."""
    if not rows:
        raise DataError("to_prompts: got no rows", fix="pass at least one PromptRow")
    names = list(rows[0].fields)
    for row in rows:
        if list(row.fields) != names:
            raise DataError(f"to_prompts: {row.source} has extra fields {list(row.fields)}, but "
                            f"{rows[0].source} has {names}", fix="batch rows loaded with the same extra_fields")
    ids, mask = encode_prompts([row.text for row in rows], tokenizer)  # [B, P], [B, P]
    meta = {"answer": [row.answer for row in rows], "text": [row.text for row in rows]}
    return Prompts(ids, mask, {**meta, **{name: [row.fields[name] for row in rows] for name in names}})


def to_demonstrations(rows: Sequence[PromptRow], tokenizer: PreTrainedTokenizerBase) -> Rollouts:
    """SFT batch: the prompts, and as each response the answer's tokens then EOS, right-padded.
    Numeric answers are written with `str`; rows without an answer are refused."""
    answers = []
    for row in rows:
        if row.answer is None or isinstance(row.answer, bool) or not isinstance(row.answer, (str, int, float)):
            raise DataError(f"to_demonstrations: {row.source} has answer {row.answer!r}; a demonstration needs "
                            "a string (or number) answer", fix="set answer_field to the field with the target text")
        answers.append(str(row.answer))
    response, mask = encode_responses(answers, tokenizer)  # [B, T], [B, T]
    return Rollouts.from_demonstrations(to_prompts(rows, tokenizer), response, mask)
