"""ModelShape against real transformers models, published parameter counts, and the presets."""

import json

import pytest
import torch
from transformers import (
    Qwen2_5_VLConfig,
    DynamicCache, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM,
    Qwen2ForTokenClassification, Qwen3Config, Qwen3ForCausalLM,
)

from rlgraph.plan.model_size import ModelShape
from rlgraph.plan.presets import PRESETS, get_preset, load_model_config, preset_names

SMALL = dict(vocab_size=61, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=6,
             num_key_value_heads=2)


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # shared (tied) tensors are yielded once


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("build", [
    lambda tied: Qwen2ForCausalLM(Qwen2Config(**SMALL, tie_word_embeddings=tied)),
    lambda tied: LlamaForCausalLM(LlamaConfig(**SMALL, tie_word_embeddings=tied)),
    lambda tied: LlamaForCausalLM(LlamaConfig(**SMALL, tie_word_embeddings=tied, attention_bias=True, mlp_bias=True, head_dim=12)),
    lambda tied: MistralForCausalLM(MistralConfig(**SMALL, tie_word_embeddings=tied, head_dim=16)),
    lambda tied: Qwen3ForCausalLM(Qwen3Config(**SMALL, tie_word_embeddings=tied, head_dim=16)),
], ids=["qwen2", "llama", "llama-biases-head_dim", "mistral-head_dim", "qwen3-qk_norm"])
def test_parameter_count_equals_a_random_init_transformers_model(build, tied):
    torch.manual_seed(0)
    model = build(tied)
    assert ModelShape.from_hf_config(model.config).n_params == n_params(model)
    assert ModelShape.from_hf_config(model.config.to_dict()).n_params == n_params(model)


def test_value_head_counts_like_a_token_classification_critic():
    model = Qwen2ForTokenClassification(Qwen2Config(**SMALL, num_labels=1))
    assert ModelShape.from_hf_config(model.config, value_head=True).n_params == n_params(model)


def test_the_shipped_tiny_model_is_counted_exactly():
    model = Qwen2ForCausalLM(Qwen2Config(**get_preset("tiny-qwen2")))
    assert ModelShape.from_hf_config(get_preset("tiny-qwen2")).n_params == n_params(model) == 126_464


@pytest.mark.parametrize("name, published", [
    ("qwen2.5-0.5b", 494_032_768), ("qwen2.5-7b", 7_615_616_512),
    ("llama3-8b", 8_030_261_248), ("llama3-70b", 70_553_706_496),
])
def test_presets_match_the_published_parameter_counts(name, published):
    assert ModelShape.from_hf_config(get_preset(name)).n_params == published


def test_kv_cache_bytes_per_token_equals_a_real_dynamic_cache():
    model = Qwen2ForCausalLM(Qwen2Config(**SMALL)).eval()
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 61, (2, 5)), past_key_values=cache, use_cache=True)
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    shape = ModelShape.from_hf_config(model.config)
    assert held == 2 * 5 * shape.kv_cache_bytes_per_token(torch.float32)
    assert shape.kv_cache_bytes_per_token() == 2 * 3 * 2 * 8 * 2  # K and V x layers x kv heads x head_dim x bf16


def test_flops_per_token_by_hand():
    shape = ModelShape(hidden=8, layers=2, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=10)
    matmuls = shape.n_params - 10 * 8  # the input embedding is a lookup, the untied head a matmul
    forward = 2 * matmuls + 4 * 2 * 32 * 8  # + QK^T and AV over a 32-token context
    assert shape.flops_per_token(32, training=False) == forward
    assert shape.flops_per_token(32, training=True) == 3 * forward
    assert shape.flops_per_token(32, training=True, recompute=True) == 4 * forward
    tied = ModelShape(hidden=8, layers=2, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=10, tie_embeddings=True)
    assert tied.flops_per_token(32, training=False) == forward  # the tied matrix still runs once, as the head


def test_missing_fields_are_named():
    config = dict(get_preset("llama3-8b"))
    del config["intermediate_size"], config["vocab_size"]
    with pytest.raises(ValueError, match="lacks intermediate_size, vocab_size.*Llama/Qwen2/Mistral-style"):
        ModelShape.from_hf_config(config)


def test_mixture_of_experts_and_bad_head_dims_are_refused():
    with pytest.raises(ValueError, match="mixture of experts"):
        ModelShape.from_hf_config({**get_preset("llama3-8b"), "num_local_experts": 8})
    with pytest.raises(ValueError, match="not divisible.*give head_dim"):
        ModelShape.from_hf_config({**SMALL, "hidden_size": 50})
    with pytest.raises(ValueError, match="not a multiple"):
        ModelShape(hidden=8, layers=1, heads=3, kv_heads=2, head_dim=4, intermediate=8, vocab=4)
    with pytest.raises(ValueError, match="positive int"):
        ModelShape(hidden=0, layers=1, heads=1, kv_heads=1, head_dim=4, intermediate=8, vocab=4)


# -- presets -------------------------------------------------------------------------------------
def test_presets_are_fresh_copies_and_unknown_names_list_the_known_ones():
    config = get_preset("llama3-8b")
    config["hidden_size"] = 1
    assert get_preset("llama3-8b")["hidden_size"] == 4096
    assert preset_names() == ["tiny-qwen2", "tiny-qwen2-vl", *sorted(PRESETS)]
    with pytest.raises(ValueError, match="unknown model preset 'gpt-5'; known presets: tiny-qwen2, tiny-qwen2-vl, llama3-70b"):
        get_preset("gpt-5")


def test_presets_build_real_transformers_configs():
    for name in PRESETS:
        config = get_preset(name)
        cls = {"qwen2": Qwen2Config, "llama": LlamaConfig, "qwen2_5_vl": Qwen2_5_VLConfig}[config["model_type"]]
        assert ModelShape.from_hf_config(cls(**config)) == ModelShape.from_hf_config(config)


def test_load_model_config_from_a_preset_a_file_or_a_directory(tmp_path):
    config = get_preset("qwen2.5-0.5b")
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_model_config("qwen2.5-0.5b") == config
    assert load_model_config(tmp_path / "config.json") == config
    assert load_model_config(str(tmp_path)) == config


def test_load_model_config_errors_say_what_to_pass(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        load_model_config(tmp_path)
    with pytest.raises(ValueError, match="does not exist; give a preset"):
        load_model_config(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_model_config(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="unknown model preset"):
        load_model_config("llama-9000")
