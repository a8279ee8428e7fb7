"""Tiny models and the character tokenizer the tests and the CPU demo run on.

Nothing here downloads: the tokenizer and the model config are shipped in `rlgraph/assets`, and
`build_causal_lm` loads a real checkpoint only from a local directory.

Rebuild the shipped assets with `python -m rlgraph.backends.local.models --write-assets`.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast

ASSETS = Path(__file__).resolve().parents[2] / "assets"
TOKENIZER_DIR = ASSETS / "char_tokenizer"
TINY_CONFIG = ASSETS / "tiny_qwen2.json"
# The same model with head_dim 32 (2 heads, 1 KV head): vLLM's CPU attention refuses head_dim 16.
TINY_VLLM_CONFIG = ASSETS / "tiny_qwen2_vllm.json"

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
ALPHABET = "0123456789+-*=() abcdefghijklmnopqrstuvwxyz"
# On the tiny model (2 CPU threads, 256 rows x 5 new tokens) "sdpa" and "eager" measured within
# noise of each other (~26 ms a generate call, ~43 ms a log-prob forward+backward); sdpa is kept
# because it does not materialise the [T, T] attention weights when sequences grow.
ATTENTION = "sdpa"
# Plain concatenation of the message contents: the tiny tokenizer has no role markers.
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
WEIGHT_FILES = (
    "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json",
)


def build_char_tokenizer(alphabet: str = ALPHABET) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: ids 0-3 are `<pad> <bos> <eos> <unk>`, then one id per character.

    Encoding prepends `<bos>` (pass `add_special_tokens=False` to skip it); decoding concatenates
    characters with no separator; characters outside the alphabet are dropped (there is no byte for
    them); padding is on the left.

    It is written as a byte-level BPE with no merges, in Qwen2's pipeline (NFC, Qwen2's split
    regex, byte-level pre-tokenizer and decoder): `AutoTokenizer.from_pretrained` on a directory
    with a qwen2 `config.json` (the tiny model, an export) does not read a tokenizer.json's
    pipeline but rebuilds Qwen2's around its vocabulary, so only a tokenizer already in that form
    encodes the same after an export (a WordLevel one lost its spaces).

    >>> tok = build_char_tokenizer("0123456789+=")
    >>> tok("1+2=")["input_ids"]
    [1, 5, 14, 6, 15]
    """
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    if len(set(alphabet)) != len(alphabet):
        raise ValueError(f"build_char_tokenizer: the alphabet has repeated characters: {alphabet!r}")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for char in alphabet:  # the byte-level form of the character: " " is "\u0120", ASCII letters are themselves
        (symbol, _), = byte_level.pre_tokenize_str(char)
        vocab[symbol] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False, byte_fallback=False))
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
                                                  byte_level])
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
        padding_side="left", clean_up_tokenization_spaces=False, chat_template=CHAT_TEMPLATE,
        model_max_length=64,
    )


def load_tokenizer(path: str | Path | None = None) -> PreTrainedTokenizerFast:
    """The tokenizer saved in `path` (default: the shipped character tokenizer), padding on the left."""
    path = Path(path) if path is not None else TOKENIZER_DIR
    if not (path / "tokenizer.json").is_file():
        raise ValueError(
            f"load_tokenizer: no tokenizer.json in {str(path)!r}; pass a directory written by "
            "`tokenizer.save_pretrained(...)`, or None for the shipped character tokenizer"
        )
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
    tokenizer.padding_side = "left"
    return tokenizer


# Text a tokenizer must treat alike after a round trip: spaces (single, repeated, leading), newlines,
# tabs, digits, punctuation, contractions, letters of both cases and non-ASCII letters.
PROBES = ("1+2=3", "12 + 34 = 46", "  two  spaces, a\ttab\nand a newline", "It's 7:30; isn't it?",
          "The Answer is (42).", "caf\u00e9 na\u00efve")


def auto_tokenizer_mismatch(tokenizer: PreTrainedTokenizerFast, directory: str | Path) -> str | None:
    """Where plain `AutoTokenizer.from_pretrained(directory)` (a model's config.json beside the saved
    tokenizer) tokenizes unlike `tokenizer`, on `PROBES` and every token of the vocabulary: ids
    (special tokens included) or decoded text; None when alike. AutoTokenizer picks the class from
    the config's model type and may rebuild that family's pipeline around the saved vocabulary
    (transformers 5 does for qwen2), ignoring the one tokenizer.json holds."""
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    special = set(tokenizer.all_special_ids)
    tokens = tokenizer.batch_decode([[i] for i in range(len(tokenizer)) if i not in special])  # one batched call
    # 16 tokens a text: short enough for a small model_max_length (the shipped tokenizer's is 64)
    texts = [*PROBES, *(" ".join(tokens[i:i + 16]) for i in range(0, len(tokens), 16))]
    mine_ids, their_ids = tokenizer(texts)["input_ids"], loaded(texts)["input_ids"]
    decoded = zip(tokenizer.batch_decode(mine_ids), loaded.batch_decode(their_ids))
    for text, mine, theirs, (mine_text, their_text) in zip(texts, mine_ids, their_ids, decoded):
        if mine != theirs or mine_text != their_text:
            shown = text if len(text) <= 80 else text[:77] + "..."
            return (f"transformers.AutoTokenizer.from_pretrained({str(directory)!r}) loads {type(loaded).__name__}, "
                    f"which does not tokenize like the run's tokenizer: {shown!r} is {theirs[:16]} there, "
                    f"{mine[:16]} in the run (decoded {their_text[:40]!r} vs {mine_text[:40]!r})")
    return None


def model_tokenizer_mismatch(tokenizer: PreTrainedTokenizerFast,
                             source: str | Path | Mapping[str, Any] | None) -> str | None:
    """`auto_tokenizer_mismatch` for the model `source` (as `build_causal_lm` takes it) before any
    weight exists: its config.json and the tokenizer in a temporary directory, as an export writes them."""
    import tempfile

    config, _ = _config_from(source)
    with tempfile.TemporaryDirectory(prefix="rlgraph-tokenizer-") as directory:
        config.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        problem = auto_tokenizer_mismatch(tokenizer, directory)
        return problem.replace(repr(directory), "OUT") if problem else None


def tiny_config(tokenizer: PreTrainedTokenizerFast | None = None) -> dict[str, Any]:
    """The shipped tiny Qwen2 config (~126k parameters) as a dict, sized to `tokenizer`."""
    tokenizer = tokenizer if tokenizer is not None else build_char_tokenizer()
    return {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "attention_dropout": 0.0,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }


def _config_from(source: str | Path | Mapping[str, Any] | None) -> tuple[PretrainedConfig, Path | None]:
    """(config, checkpoint directory holding weights or None) for any accepted `source`."""
    if source is None:
        source = TINY_CONFIG
    if isinstance(source, Mapping):
        return _config_from_dict(dict(source), "the config dict"), None
    path = Path(source)
    if path.is_dir():
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ValueError(f"build_causal_lm: directory {str(path)!r} has no config.json; save a model there "
                             "with `model.save_pretrained(dir)` or pass the path of a config JSON")
        config = _config_from_dict(json.loads(config_file.read_text()), str(config_file))
        has_weights = any((path / name).is_file() for name in WEIGHT_FILES)
        return config, path if has_weights else None
    if not path.is_file():
        raise ValueError(f"build_causal_lm: {str(path)!r} does not exist; pass a checkpoint directory, a config "
                         "JSON file, a config dict, or None for the shipped tiny Qwen2")
    return _config_from_dict(json.loads(path.read_text()), str(path)), None


def _config_from_dict(fields: dict[str, Any], where: str) -> PretrainedConfig:
    model_type = fields.pop("model_type", None)
    if not model_type:
        raise ValueError(f"build_causal_lm: {where} has no 'model_type' field; add one such as \"qwen2\" or \"llama\"")
    fields.pop("transformers_version", None)
    return AutoConfig.for_model(model_type, **fields)


def config_only(source: Any) -> Any:
    """`source` without its checkpoint: a model directory becomes its config.json (a build whose
    weights come from elsewhere, a start-up file or a rank's shard, must not read the directory's)."""
    if isinstance(source, (str, os.PathLike)) and Path(source).is_dir():
        return Path(source) / "config.json"
    return source


def build_causal_lm(
    source: str | Path | Mapping[str, Any] | None = None,
    *,
    tokenizer: PreTrainedTokenizerFast | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = ATTENTION,
) -> PreTrainedModel:
    """A causal LM, in train mode, on the CPU.

    `source` is a checkpoint directory (config.json + weights: loaded with `from_pretrained`, local
    files only), a directory or file holding only a config, a config dict, or None (the shipped
    tiny Qwen2). Without weights the parameters are drawn from a generator seeded with `seed`, so
    the same source and seed give the same model; the global RNG state is left untouched.
    Raises ValueError when the source is missing, has no `model_type`, or its vocabulary is
    smaller than `tokenizer`'s.
    """
    config, checkpoint = _config_from(source)
    if tokenizer is not None and config.vocab_size < len(tokenizer):
        raise ValueError(
            f"build_causal_lm: the config's vocab_size={config.vocab_size} is smaller than the tokenizer "
            f"({len(tokenizer)} tokens); set vocab_size >= {len(tokenizer)} in the config"
        )
    if checkpoint is not None:
        model = AutoModelForCausalLM.from_pretrained(
            str(checkpoint), local_files_only=True, dtype=dtype, attn_implementation=attn_implementation
        )
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    return model.train()


def write_assets(directory: str | Path = ASSETS, alphabet: str = ALPHABET) -> None:
    """(Re)write `char_tokenizer/`, `tiny_qwen2.json` and `tiny_qwen2_vllm.json` in `directory` (default: the shipped assets)."""
    directory = Path(directory)
    tokenizer = build_char_tokenizer(alphabet)
    tokenizer.save_pretrained(str(directory / TOKENIZER_DIR.name))
    (directory / TINY_CONFIG.name).write_text(json.dumps(tiny_config(tokenizer), indent=2) + "\n")
    vllm_sized = {**tiny_config(tokenizer), "num_attention_heads": 2, "num_key_value_heads": 1}
    (directory / TINY_VLLM_CONFIG.name).write_text(json.dumps(vllm_sized, indent=2) + "\n")


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write-assets", action="store_true", help=f"rewrite {TOKENIZER_DIR} and {TINY_CONFIG}")
    args = parser.parse_args()
    if not args.write_assets:
        parser.error("nothing to do: pass --write-assets")
    write_assets()
    model = build_causal_lm()
    print(f"wrote {TOKENIZER_DIR} ({len(load_tokenizer())} tokens) and {TINY_CONFIG} "
          f"({sum(p.numel() for p in model.parameters()):,} parameters)")


if __name__ == "__main__":
    _main()
