import json

import pytest
import torch

from rlgraph.backends.local.models import load_tokenizer
from rlgraph.data.pretrain import Packer, TextStream, segment_batch
from rlgraph.data.prompts import DataError

TOKENIZER = load_tokenizer(None)  # the shipped character tokenizer: one token per letter
BOS, EOS, PAD = TOKENIZER.bos_token_id, TOKENIZER.eos_token_id, TOKENIZER.pad_token_id


def ids(text):
    return TOKENIZER(text, add_special_tokens=False)["input_ids"]


@pytest.fixture
def corpus(tmp_path):
    """Three documents, one .txt file each, read in name order."""
    for name, text in (("1.txt", "ab"), ("2.txt", "cde"), ("3.txt", "f")):
        (tmp_path / name).write_text(text)
    return tmp_path


def packer(path, seq_len=4, packs_per_step=1):
    return Packer(TextStream.open(path), TOKENIZER, seq_len=seq_len, packs_per_step=packs_per_step)


def test_packs_hold_exactly_seq_len_tokens_cut_at_document_boundaries(corpus):
    a, b, c, d, e, f = ids("abcdef")
    stream = packer(corpus)
    # the token stream: a b EOS | c d e EOS | f EOS | (epoch 2) a b EOS ...
    assert stream.next_pack() == [[a, b, EOS], [c]]
    assert stream.next_pack() == [[d, e, EOS], [f]]
    assert stream.next_pack() == [[EOS], [a, b, EOS]]  # the third document's end, then the second epoch
    assert stream.state_dict() == {"epoch": 1, "document": 1, "offset": 0, "steps": 0, "seq_len": 4, "packs_per_step": 1}


def test_a_batch_is_one_row_per_segment_with_the_start_token_as_prompt(corpus):
    a, b, c = ids("abc")
    batch = packer(corpus).next_batch()
    assert batch.prompt_ids.tolist() == [[BOS], [BOS]]
    assert batch.response_ids.tolist() == [[a, b, EOS], [c, PAD, PAD]]
    assert batch.mask.tolist() == [[True, True, True], [True, False, False]]
    assert int(batch.mask.sum()) == 4  # seq_len tokens of targets a step: no token is lost or repeated


def test_a_resumed_packer_continues_mid_document_with_the_same_batches(corpus):
    whole = packer(corpus, seq_len=4, packs_per_step=1)
    expected = [whole.next_batch().response_ids for _ in range(5)]
    first = packer(corpus, seq_len=4, packs_per_step=1)
    for _ in range(2):
        first.next_batch()
    state = first.state_dict()
    assert state["offset"] > 0  # the cut is inside a document
    resumed = packer(corpus, seq_len=4, packs_per_step=1)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # as a checkpoint stores it
    assert all(torch.equal(resumed.next_batch().response_ids, want) for want in expected[2:])


def test_jsonl_and_single_text_sources(tmp_path):
    (tmp_path / "docs.jsonl").write_text('{"body": "ab"}\n\n{"body": "c"}\n')
    stream = TextStream.open(tmp_path / "docs.jsonl", text_field="body")
    assert list(stream.documents()) == ["ab", "c"] and list(stream.documents(1)) == ["c"]
    (tmp_path / "one.txt").write_text("abc")
    assert list(TextStream.open(tmp_path / "one.txt").documents()) == ["abc"]


@pytest.mark.parametrize("make, message", [
    (lambda p: p / "missing.txt", "no such file"),
    (lambda p: (p / "empty").mkdir() or p / "empty", "without .txt files"),
    (lambda p: (p / "x.txt").write_bytes(b"\xff\xfe") and p / "x.txt", "not UTF-8"),
    (lambda p: (p / "x.jsonl").write_text('{"text": "a"}\n{oops\n') and p / "x.jsonl", r"x.jsonl:2: not valid JSON"),
    (lambda p: (p / "x.jsonl").write_text('{"content": "a"}\n') and p / "x.jsonl", "no string field 'text'"),
])
def test_bad_sources_are_refused_naming_the_file_and_line(tmp_path, make, message):
    with pytest.raises(DataError, match=message):
        stream = TextStream.open(make(tmp_path))
        list(stream.documents())


@pytest.mark.parametrize("seq_len, packs", [(0, 1), (True, 1), ("48", 1), (4, 0), (4, -2), (4, 1.5)])
def test_bad_packing_is_refused(corpus, seq_len, packs):
    with pytest.raises(DataError, match="pretrain.(seq_len|packs_per_step) must be a whole number"):
        packer(corpus, seq_len=seq_len, packs_per_step=packs)


def test_a_state_of_another_packing_or_corpus_is_refused(corpus):
    state = packer(corpus).state_dict()
    with pytest.raises(DataError, match="seq_len=5"):
        packer(corpus, seq_len=5).load_state_dict(state)
    with pytest.raises(DataError, match="past the end of the corpus"):
        packer(corpus).load_state_dict({**state, "document": 7})


def test_segment_batch_pads_right():
    batch = segment_batch([[5, 6], [7]], start_id=1, pad_id=0)
    assert batch.response_ids.tolist() == [[5, 6], [7, 0]] and batch.prompt_ids.tolist() == [[1], [1]]
