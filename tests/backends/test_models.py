import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlgraph.backends.local.models import (
    ALPHABET, SPECIAL_TOKENS, TINY_CONFIG, build_causal_lm, build_char_tokenizer, load_tokenizer, tiny_config,
    write_assets,
)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


# --- tokenizer ---------------------------------------------------------------------------------

def test_shipped_tokenizer_layout(tokenizer):
    assert len(tokenizer) == len(SPECIAL_TOKENS) + len(ALPHABET) == 47
    special = [tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id]
    assert special == [0, 1, 2, 3]
    assert tokenizer.padding_side == "left"
    assert tokenizer("1+2=")["input_ids"] == [1, 5, 14, 6, 17]
    assert tokenizer("1+2=", add_special_tokens=False)["input_ids"] == [5, 14, 6, 17]
    assert tokenizer("A")["input_ids"] == [1]  # upper case is not in the alphabet: dropped, as Qwen2Tokenizer does


def test_shipped_assets_are_up_to_date(tokenizer, tmp_path):
    write_assets(tmp_path)
    assert json.loads((tmp_path / "tiny_qwen2.json").read_text()) == json.loads(TINY_CONFIG.read_text())
    rebuilt = load_tokenizer(tmp_path / "char_tokenizer")
    assert rebuilt.get_vocab() == tokenizer.get_vocab()
    assert tiny_config(tokenizer)["vocab_size"] == len(tokenizer)


@given(st.text(alphabet=ALPHABET, max_size=20))
def test_encode_decode_round_trip(tokenizer, text):
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text) + 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_left_padding(tokenizer):
    batch = tokenizer(["12+3=", "1+2="], padding=True, return_tensors="pt")
    assert batch["input_ids"][1].tolist() == [0, 1, 5, 14, 6, 17]
    assert batch["attention_mask"][1].tolist() == [0, 1, 1, 1, 1, 1]


def test_build_char_tokenizer_refuses_repeated_characters():
    with pytest.raises(ValueError, match="repeated"):
        build_char_tokenizer("aab")


def test_load_tokenizer_missing_directory(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)


# --- models ------------------------------------------------------------------------------------

def test_tiny_model_size_and_ids(tokenizer):
    model = build_causal_lm(tokenizer=tokenizer)
    assert 100_000 <= sum(p.numel() for p in model.parameters()) <= 150_000
    assert model.config.vocab_size == len(tokenizer)
    assert (model.config.pad_token_id, model.config.bos_token_id, model.config.eos_token_id) == (0, 1, 2)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.training


def test_random_init_is_seeded_and_leaves_global_rng_alone():
    before = torch.random.get_rng_state()
    a, b, c = build_causal_lm(seed=3), build_causal_lm(seed=3), build_causal_lm(seed=4)
    assert torch.equal(torch.random.get_rng_state(), before)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    assert not torch.equal(a.model.layers[0].mlp.up_proj.weight, c.model.layers[0].mlp.up_proj.weight)


def test_sources_dict_json_and_config_only_directory_agree(tmp_path):
    config = tiny_config()
    (tmp_path / "config.json").write_text(json.dumps(config))
    models = [build_causal_lm(config), build_causal_lm(tmp_path / "config.json"), build_causal_lm(tmp_path),
              build_causal_lm(str(TINY_CONFIG)), build_causal_lm()]
    for other in models[1:]:
        for pa, pb in zip(models[0].parameters(), other.parameters()):
            assert torch.equal(pa, pb)


def test_save_pretrained_round_trip_gives_identical_logits(tmp_path, tokenizer):
    model = build_causal_lm(seed=1).eval()
    with torch.no_grad():
        model.model.norm.weight.add_(0.5)  # a trained-looking model, not a fresh init
    model.save_pretrained(tmp_path)
    loaded = build_causal_lm(tmp_path, tokenizer=tokenizer, seed=99).eval()
    batch = tokenizer(["12+3=", "1+2="], padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = model(**batch).logits
        got = loaded(**batch).logits
    assert torch.equal(got, expected)


def test_dtype():
    model = build_causal_lm(dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_errors_name_the_problem(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="does not exist"):
        build_causal_lm(tmp_path / "nope")
    with pytest.raises(ValueError, match="has no config.json"):
        build_causal_lm(tmp_path)
    with pytest.raises(ValueError, match="no 'model_type'"):
        build_causal_lm({k: v for k, v in tiny_config().items() if k != "model_type"})
    (tmp_path / "bad.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="bad.json has no 'model_type'"):
        build_causal_lm(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="vocab_size=10 is smaller than the tokenizer"):
        build_causal_lm({**tiny_config(), "vocab_size": 10}, tokenizer=tokenizer)
