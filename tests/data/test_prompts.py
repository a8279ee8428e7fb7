import json
import re

import pyarrow
import pyarrow.parquet
import pytest
import torch

from rlgraph.backends.local.models import build_char_tokenizer, load_tokenizer
from rlgraph.data.prompts import (
    DataError, DataReport, PromptRow, encode_texts, load_prompts, read_records, split_holdout, to_demonstrations,
    to_prompts,
)

ROWS = [{"prompt": "1+2=", "answer": "3", "id": 1}, {"prompt": "10+20=", "answer": "30", "id": 2},
        {"prompt": "7*6=", "answer": "42", "id": 3}]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def write_jsonl(path, rows, blank_after=None):
    lines = [json.dumps(row) for row in rows]
    if blank_after is not None:
        lines.insert(blank_after, "")
    path.write_text("\n".join(lines) + "\n")
    return path


def write_csv(path, text):
    path.write_text(text)
    return path


def row(text, answer="1", source="t.jsonl:1", **fields):
    return PromptRow(text, answer, fields, source)


# ---- reading each format ------------------------------------------------------------------------

def test_jsonl_rows_keep_their_line_numbers(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "train.jsonl", ROWS, blank_after=1)  # line 2 is blank
    assert read_records(path) == ROWS
    rows, report = load_prompts(path, tokenizer, extra_fields=["id"])
    assert [r.source for r in rows] == [f"{path}:1", f"{path}:3", f"{path}:4"]
    assert [(r.text, r.answer, dict(r.fields)) for r in rows] == [
        ("1+2=", "3", {"id": 1}), ("10+20=", "30", {"id": 2}), ("7*6=", "42", {"id": 3})]
    assert report == DataReport(str(path), 3, 3, {}) and report.summary() == f"{path}: kept 3 of 3 rows"


def test_json_array_file(tmp_path):
    path = tmp_path / "train.json"
    path.write_text(json.dumps(ROWS, indent=2))
    assert read_records(path) == ROWS


def test_csv_values_are_strings(tmp_path, tokenizer):
    path = write_csv(tmp_path / "train.csv", 'prompt,answer,level\n1+2=,3,easy\n"10+20=",30,hard\n')
    assert read_records(path) == [{"prompt": "1+2=", "answer": "3", "level": "easy"},
                                  {"prompt": "10+20=", "answer": "30", "level": "hard"}]
    rows, _ = load_prompts(path, tokenizer, extra_fields=["level"])
    assert [r.source for r in rows] == [f"{path}:2", f"{path}:3"]


def test_parquet(tmp_path):
    path = tmp_path / "train.parquet"
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(ROWS), path)
    assert read_records(path) == ROWS
    assert read_records(path, format="parquet") == ROWS


def test_datasets_directory_and_splits(tmp_path, tokenizer):
    import datasets

    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "plain"))
    assert read_records(tmp_path / "plain") == ROWS
    both = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:2]),
                                 "test": datasets.Dataset.from_list(ROWS[2:])})
    both.save_to_disk(str(tmp_path / "dict"))
    rows, _ = load_prompts(tmp_path / "dict", tokenizer, split="test")
    assert [(r.text, r.source) for r in rows] == [("7*6=", f"{tmp_path / 'dict'}[test] row 1")]
    with pytest.raises(DataError, match=r"has no split 'tset'; did you mean 'test'\?; its splits are \['train', 'test'\]"):
        read_records(tmp_path / "dict", split="tset")
    with pytest.raises(DataError, match=r"has several splits; its splits are \['train', 'test'\]"):
        read_records(tmp_path / "dict")
    with pytest.raises(DataError, match="split='train' given, but the saved dataset has no splits"):
        read_records(tmp_path / "plain", split="train")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(DataError, match="not a directory written by `datasets` save_to_disk"):
        read_records(tmp_path / "empty_dir")


# ---- prompts, answers and fields reach the batch ------------------------------------------------

def test_answers_and_extra_fields_land_in_meta(tmp_path, tokenizer):
    rows, _ = load_prompts(write_jsonl(tmp_path / "t.jsonl", ROWS), tokenizer, extra_fields=["id"])
    prompts = to_prompts(rows, tokenizer)
    assert prompts.meta == {"answer": ["3", "30", "42"], "text": ["1+2=", "10+20=", "7*6="], "id": [1, 2, 3]}
    assert prompts.ids.shape == (3, 7) and prompts.mask.sum(1).tolist() == [5, 7, 5]
    assert prompts.mask[0].tolist() == [False, False, True, True, True, True, True]  # left-padded
    assert prompts.ids[0, :2].tolist() == [tokenizer.pad_token_id] * 2 and prompts.ids[0, 2] == tokenizer.bos_token_id
    assert tokenizer.batch_decode(prompts.ids, skip_special_tokens=True) == ["1+2=", "10+20=", "7*6="]


def test_no_answer_field(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "1+1="}])
    rows, _ = load_prompts(path, tokenizer, answer_field=None)
    assert rows[0].answer is None and to_prompts(rows, tokenizer).meta["answer"] == [None]
    with pytest.raises(DataError, match=rf"to_demonstrations: {path}:1 has answer None"):
        to_demonstrations(rows, tokenizer)


def test_demonstrations_are_answer_then_eos(tokenizer):
    rows = [row("1+2=", "3"), row("5*8=", 40)]  # a numeric answer is written with str()
    demo = to_demonstrations(rows, tokenizer)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    three, four, zero = (tokenizer.convert_tokens_to_ids(c) for c in "340")
    assert demo.response_ids.tolist() == [[three, eos, pad], [four, zero, eos]]
    assert demo.mask.tolist() == [[True, True, False], [True, True, True]]
    assert torch.equal(demo.prompt_ids, to_prompts(rows, tokenizer).ids) and demo.meta["answer"] == ["3", 40]
    for bad in ([1, 2], True, {"x": 1}):
        with pytest.raises(DataError, match=re.escape(f"has answer {bad!r}; a demonstration needs a string")):
            to_demonstrations([row("1+2=", bad)], tokenizer)


def test_to_prompts_refuses_mixed_fields_and_no_rows(tokenizer):
    with pytest.raises(DataError, match=r"b.jsonl:2 has extra fields \['k'\], but a.jsonl:1 has \[\]"):
        to_prompts([row("1=", source="a.jsonl:1"), row("2=", source="b.jsonl:2", k=1)], tokenizer)
    with pytest.raises(DataError, match="got no rows"):
        to_prompts([], tokenizer)


# ---- chat templates -----------------------------------------------------------------------------

def test_templates(tmp_path, tokenizer):
    chat = [{"prompt": [{"role": "user", "content": "what is "}, {"role": "user", "content": "1+2"}], "answer": "3"}]
    path = write_jsonl(tmp_path / "chat.jsonl", chat)
    # The shipped template concatenates the contents; "auto" applies it because the tokenizer has one.
    assert load_prompts(path, tokenizer)[0][0].text == "what is 1+2"
    assert load_prompts(path, tokenizer, system_prompt="be brief ")[0][0].text == "be brief what is 1+2"
    plain = write_jsonl(tmp_path / "plain.jsonl", ROWS[:1])
    assert load_prompts(plain, tokenizer, chat_template=False)[0][0].text == "1+2="
    custom = "{% for m in messages %}({{ m['role'] }}) {{ m['content'] }}{% endfor %}="
    assert load_prompts(plain, tokenizer, chat_template=custom, system_prompt="s")[0][0].text == "(system) s(user) 1+2=="
    bare = build_char_tokenizer()
    bare.chat_template = None
    assert load_prompts(plain, bare)[0][0].text == "1+2="  # "auto" without a template: the raw string
    with pytest.raises(DataError, match="chat_template is true but the tokenizer has no chat template"):
        load_prompts(plain, bare, chat_template=True)


def test_a_template_that_writes_bos_does_not_get_a_second_one(tokenizer):
    assert encode_texts(["<bos>1+2=", "1+2="], tokenizer) == [tokenizer("1+2=")["input_ids"]] * 2
    assert tokenizer("1+2=")["input_ids"][0] == tokenizer.bos_token_id


# ---- the drop report ----------------------------------------------------------------------------

def test_empty_and_long_prompts_are_dropped_and_counted(tmp_path, tokenizer):
    data = ROWS + [{"prompt": "   ", "answer": "0"}, {"prompt": None, "answer": "0"},
                   {"prompt": [{"role": "user", "content": ""}], "answer": "0"}, {"prompt": "123+456=", "answer": "579"}]
    path = write_jsonl(tmp_path / "t.jsonl", data)
    rows, report = load_prompts(path, tokenizer, max_prompt_tokens=6)  # BOS + 5 characters
    assert [r.text for r in rows] == ["1+2=", "7*6="]
    assert report == DataReport(str(path), 7, 2, {"empty prompt": 3, "prompt longer than 6 tokens": 2})
    assert report.summary() == f"{path}: kept 2 of 7 rows; dropped 3 (empty prompt), 2 (prompt longer than 6 tokens)"
    assert load_prompts(path, tokenizer, max_prompt_tokens=9)[1].dropped == {"empty prompt": 3}


def test_nothing_left_is_an_error_saying_why(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "t.jsonl", ROWS + [{"prompt": "", "answer": "1"}])
    with pytest.raises(DataError, match=r"none of its 4 rows is usable: 3 dropped as prompt longer than 2 tokens, "
                                        r"1 dropped as empty prompt"):
        load_prompts(path, tokenizer, max_prompt_tokens=2)


# ---- holdout split ------------------------------------------------------------------------------

def test_split_holdout_is_seeded_and_partitions(tokenizer):
    rows = [row(f"{i}+1=", source=f"t.jsonl:{i + 1}") for i in range(20)]
    train, held = split_holdout(rows, 0.25, seed=3)
    assert (len(train), len(held)) == (15, 5) and sorted(train + held, key=rows.index) == rows
    assert train == sorted(train, key=rows.index)  # file order kept
    assert split_holdout(rows, 0.25, seed=3) == (train, held) and split_holdout(rows, 0.25, seed=4)[1] != held
    assert split_holdout(rows, 0.01, seed=0)[1].__len__() == 1  # a positive fraction holds out at least one row
    assert split_holdout(rows, 0, seed=0) == (rows, [])


@pytest.mark.parametrize(("fraction", "count", "message"), [
    (1.5, 4, r"fraction must be a number in \[0, 1\), got 1.5"),
    (-0.1, 4, r"fraction must be a number in \[0, 1\), got -0.1"),
    ("0.1", 4, r"fraction must be a number in \[0, 1\), got '0.1'"),
    (True, 4, r"got True"),
    (float("nan"), 4, r"got nan"),
    (0.8, 2, r"holding out 0.8 of 2 rows \(2\) leaves none to train on"),
])
def test_split_holdout_bad_fractions(fraction, count, message):
    with pytest.raises(DataError, match=message):
        split_holdout([row(f"{i}=") for i in range(count)], fraction, seed=0)


# ---- bad files and rows: each error names the file, the row and the field ------------------------

def test_missing_field_names_row_fields_and_closest(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "t.jsonl", [{"questions": "1+2=", "answer": "3"}])
    with pytest.raises(DataError, match=rf"{path}:1: field 'question' is missing; the row has fields "
                                        r"\['answer', 'questions'\]; did you mean 'questions'\?") as error:
        load_prompts(path, tokenizer, prompt_field="question")
    assert "set prompt_field to a field the rows have" in str(error.value)
    path = write_jsonl(tmp_path / "u.jsonl", ROWS[:1] + [{"prompt": "2="}])
    with pytest.raises(DataError, match=rf"{path}:2: field 'answer' is missing(?s:.*)answer_field=None for prompts"):
        load_prompts(path, tokenizer)
    with pytest.raises(DataError, match=rf"{path}:1: field 'level' is missing(?s:.*)set extra_fields"):
        load_prompts(path, tokenizer, extra_fields=["level"])


@pytest.mark.parametrize(("name", "text", "message"), [
    ("bad.jsonl", '{"prompt": "1="}\n{"prompt": "2=",}\n', r"bad.jsonl:2: not valid JSON \(Expecting property name"),
    ("list.jsonl", '{"prompt": "1="}\n\n["2="]\n', r"list.jsonl:3: expected a JSON object .*got list"),
    ("array.json", '[{"prompt": "1="},\n 3]', r"array.json row 2: expected a JSON object .*got int"),
    ("cut.json", '[{"prompt": "1="},\n {"prompt": ', r"cut.json:2: not valid JSON"),
    ("empty.jsonl", "\n\n", "empty.jsonl: the file holds no rows"),
    ("empty.csv", "", "empty.csv: the file holds no rows"),
    ("short.csv", "prompt,answer\n1=,1\n2=\n", r"short.csv:3: the row has 1 values but the header has 2 columns"),
    ("long.csv", "prompt,answer\n1=,1,x,y\n", r"long.csv:2: the row has 4 values but the header has 2 columns"),
    ("twice.csv", "prompt,prompt\n1=,1\n", r"twice.csv:1: the header repeats column\(s\) \['prompt'\]"),
    ("bad.parquet", "not parquet", "bad.parquet: not a readable Parquet file"),
    ("latin.jsonl", b'{"prompt": "caf\xe9"}\n', "latin.jsonl: not UTF-8 text"),
    ("data.txt", "1+2=\n", r"data.txt: cannot tell the format from the suffix '.txt'(?s:.*)\.jsonl, \.json, \.parquet, \.csv"),
])
def test_bad_files(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(DataError, match=message):
        read_records(path)


def test_bad_paths_formats_and_splits(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", ROWS)
    with pytest.raises(DataError, match="nope.jsonl: no such file or directory"):
        read_records(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match=r"unknown format 'jsnol'; did you mean 'jsonl'\?"):
        read_records(path, format="jsnol")
    with pytest.raises(DataError, match=r"split='train' only applies to a `datasets.save_to_disk` directory, and "
                                        r"this is a jsonl file"):
        read_records(path, split="train")
    with pytest.raises(DataError, match="is a directory, so format='csv' cannot read it"):
        read_records(tmp_path, format="csv")
    assert read_records(path.rename(tmp_path / "t.txt"), format="json") == ROWS  # an explicit format beats the suffix


@pytest.mark.parametrize(("prompt", "options", "message"), [
    (42, {}, r"t.jsonl:1: field 'prompt' must be a string or a list of chat messages, got int '42'"),
    ([{"role": "user"}], {}, r"t.jsonl:1: field 'prompt' message 1 needs string 'role' and 'content'"),
    ([{"role": "user", "content": "1="}], {"chat_template": False}, "holds chat messages but no chat template"),
    ([{"role": "system", "content": "x"}, {"role": "user", "content": "1="}], {"system_prompt": "y"},
     "t.jsonl:1: the row has its own system message and system_prompt is set too"),
    ("1=", {"chat_template": "{% for m in messages %}{{ m.nope() }}{% endfor %}"},
     "t.jsonl:1: the chat template failed on this row"),
])
def test_bad_prompt_values(tmp_path, tokenizer, prompt, options, message):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": prompt, "answer": "1"}])
    with pytest.raises(DataError, match=message):
        load_prompts(path, tokenizer, **options)


@pytest.mark.parametrize(("options", "message"), [
    ({"prompt_field": ""}, "prompt_field must be a field name .*got ''"),
    ({"prompt_field": None}, "prompt_field must be a field name .*got None"),
    ({"prompt_field": 3}, "prompt_field must be a field name .*got 3"),
    ({"answer_field": ""}, "answer_field must be a field name"),
    ({"answer_field": ["answer"]}, r"answer_field must be a field name .*got \['answer'\]"),
    ({"answer_field": 0}, "answer_field must be a field name .*got 0"),
    ({"extra_fields": "id"}, r"extra_fields must be a list of field names, got 'id'\n  fix: write extra_fields=\['id'\]"),
    ({"extra_fields": ["answer"]}, "extra field 'answer' is a name rlgraph fills itself"),
    ({"extra_fields": ["id", "id"]}, "extra field 'id' is listed twice"),
    ({"extra_fields": [""]}, "each of extra_fields must be a field name"),
    ({"max_prompt_tokens": 0}, "max_prompt_tokens must be a positive integer or None, got 0"),
    ({"max_prompt_tokens": True}, "max_prompt_tokens must be a positive integer or None, got True"),
    ({"max_prompt_tokens": "256"}, "max_prompt_tokens must be a positive integer or None, got '256'"),
    ({"chat_template": "atuo"}, "chat_template must be 'auto', true, false or a Jinja template, got 'atuo'"),
    ({"chat_template": 1.0}, "chat_template must be 'auto', true, false or a Jinja template, got 1.0"),
    ({"chat_template": None}, "chat_template must be 'auto', true, false or a Jinja template, got None"),
    ({"system_prompt": 3}, "system_prompt must be a string or None, got 3"),
    ({"system_prompt": "x", "chat_template": False}, "system_prompt needs a chat template, but chat_template is false"),
    ({"system_prompt": ["x"]}, r"system_prompt must be a string or None, got \['x'\]"),
])
def test_bad_options_are_refused_before_reading(tmp_path, tokenizer, options, message):
    path = tmp_path / "not_read.jsonl"  # does not exist: the options are checked first
    with pytest.raises(DataError, match=message):
        load_prompts(path, tokenizer, **options)


def test_a_tokenizer_without_pad_is_refused_with_the_fix(tokenizer):
    bare = build_char_tokenizer()
    bare.pad_token = None
    with pytest.raises(DataError, match="the tokenizer has no pad token, needed to batch prompts(?s:.*)tokenizer.pad_token ="):
        to_prompts([row("1=")], bare)


def test_data_error_is_an_rlgraph_error_and_a_value_error():
    from rlgraph.errors import ConfigError, RLGraphError

    assert issubclass(DataError, RLGraphError) and issubclass(DataError, ValueError) and issubclass(DataError, ConfigError)
