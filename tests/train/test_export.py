"""`rlgraph export`: the exported directory's tokenizer, loaded by plain `AutoTokenizer`, is the run's."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from rlgraph.backends.local.models import TINY_CONFIG
from rlgraph.errors import ConfigError
from rlgraph.train.export import export_run
from rlgraph.train.run import load_run_config, train
from rlgraph.train.setup import _tokenizer
from tests.train.test_run import make_config

TEXTS = ["3+4=", "12 + 34 = 46", "  a  b c\nd", "the answer is 7"]
# Only the weights must exist: one RL step, no warm start, no evaluation.
SHORT = ["train.steps=1", "warm_start.steps=0", "eval.every=0", "data.eval_fraction=0"]


def short_run(tmp_path: Path, name: str, overrides=()) -> Path:
    config, _ = make_config(tmp_path, name, [*SHORT, *overrides])
    train(config)
    return tmp_path / name


def assert_round_trip(run_dir: Path, out: Path) -> None:
    """Plain AutoTokenizer on the export gives the run's ids and decodes them back the same."""
    run_tokenizer = _tokenizer(load_run_config(run_dir))
    loaded = AutoTokenizer.from_pretrained(str(out))
    for text in TEXTS:
        ids = run_tokenizer(text)["input_ids"]
        assert loaded(text)["input_ids"] == ids, text
        assert loaded.decode(ids, skip_special_tokens=True) == run_tokenizer.decode(ids, skip_special_tokens=True)
    assert run_tokenizer.decode(run_tokenizer("12 + 34 = 46")["input_ids"], skip_special_tokens=True) == "12 + 34 = 46"


def bpe_model_dir(tmp_path: Path, name: str, core: Tokenizer) -> Path:
    """A tiny qwen2 config sized to the trained tokenizer `core`, with that tokenizer saved beside it."""
    bos = core.token_to_id("<bos>")
    core.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                        padding_side="left")
    directory = tmp_path / name
    tokenizer.save_pretrained(str(directory))
    config = json.loads(TINY_CONFIG.read_text())
    ids = {key: core.token_to_id(token) for key, token in
           (("pad_token_id", "<pad>"), ("bos_token_id", "<bos>"), ("eos_token_id", "<eos>"))}
    (directory / "config.json").write_text(json.dumps({**config, **ids, "vocab_size": len(tokenizer)}))
    return directory


def train_bpe(core: Tokenizer, initial_alphabet=()) -> Tokenizer:
    corpus = [f"{a}+{b}={a + b}" for a in range(8) for b in range(8)] + ["the answer is 12 and 34"] * 8
    trainer = trainers.BpeTrainer(vocab_size=len(initial_alphabet) + 60, special_tokens=["<pad>", "<bos>", "<eos>"],
                                  initial_alphabet=list(initial_alphabet), show_progress=False)
    core.train_from_iterator(corpus, trainer)
    return core


def test_export_of_the_shipped_tokenizer_round_trips(tmp_path):
    config, _ = make_config(tmp_path, "char", SHORT)
    console = Console(file=io.StringIO(), width=400)
    train(config, console=console)
    assert "warning" not in console.file.getvalue()
    run_dir = tmp_path / "char"
    out = export_run(run_dir, tmp_path / "hf")
    assert (out / "config.json").is_file()  # AutoTokenizer sees a qwen2 model: the case that dropped spaces
    assert_round_trip(run_dir, out)


def test_export_of_a_byte_level_bpe_in_qwen2_form_round_trips(tmp_path):
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core = Tokenizer(models.BPE(unk_token=None))
    core.normalizer = normalizers.NFC()
    split = pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), "isolated")
    core.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    core.decoder = decoders.ByteLevel()
    model_dir = bpe_model_dir(tmp_path, "bpe", train_bpe(core, pre_tokenizers.ByteLevel.alphabet()))
    run_dir = short_run(tmp_path, "bpe-run", [f"model.path={model_dir}"])
    tokens = _tokenizer(load_run_config(run_dir))("the answer", add_special_tokens=False)["input_ids"]
    assert len(tokens) < len("the answer")  # merges are used: a real BPE
    assert_round_trip(run_dir, export_run(run_dir, tmp_path / "hf"))


def test_export_of_a_tokenizer_autotokenizer_would_rebuild_differently_is_refused(tmp_path):
    core = Tokenizer(models.BPE(unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()  # Qwen2Tokenizer swaps it for byte-level: spaces would change
    model_dir = bpe_model_dir(tmp_path, "ws", train_bpe(core))
    console = Console(file=io.StringIO(), width=400)
    config, _ = make_config(tmp_path, "ws-run", [*SHORT, f"model.path={model_dir}"])
    train(config, console=console)  # said when the run starts, not only when it is exported
    assert "warning: rlgraph export will refuse this run's tokenizer: transformers.AutoTokenizer.from_pretrained(" \
           "OUT) loads Qwen2Tokenizer" in console.file.getvalue()
    run_dir = tmp_path / "ws-run"
    with pytest.raises(ConfigError, match=r"AutoTokenizer.from_pretrained\(.*\) loads Qwen2Tokenizer, which does not "
                                          r"tokenize like the run's tokenizer(.|\n)*fix: train with a tokenizer"):
        export_run(run_dir, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()  # a refused export leaves nothing
    out = export_run(run_dir, tmp_path / "hf", check_tokenizer=False)
    assert PreTrainedTokenizerFast.from_pretrained(str(out))("3+4=")["input_ids"] == \
        _tokenizer(load_run_config(run_dir))("3+4=")["input_ids"]
