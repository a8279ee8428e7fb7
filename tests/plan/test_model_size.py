import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from rlgraph.plan import memory as M
from rlgraph.plan.model_size import ModelShape
from rlgraph.plan.presets import get_preset, load_model_config

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=48, vocab_size=50)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_parameter_count_matches_transformers(family, tied):
    config_cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if family == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    config = config_cls(**SMALL, tie_word_embeddings=tied)
    model = model_cls(config)
    expected = sum(p.numel() for p in model.parameters())
    assert ModelShape.from_hf_config(config.to_dict()).n_params == expected


def test_presets_have_their_published_sizes():
    assert abs(ModelShape.from_hf_config(get_preset("llama3-8b")).n_params / 1e9 - 8.03) < 0.01
    assert abs(ModelShape.from_hf_config(get_preset("llama3-70b")).n_params / 1e9 - 70.55) < 0.05
    assert ModelShape.from_hf_config(load_model_config("tiny-qwen2")).n_params == 126_464


def test_missing_config_field_is_named():
    with pytest.raises(ValueError, match="hidden_size"):
        ModelShape.from_hf_config({"num_hidden_layers": 2})


def test_more_shards_need_less_memory_per_rank():
    shape = ModelShape.from_hf_config(get_preset("llama3-8b"))
    totals = [M.train_memory(shape, M.TrainMemoryConfig(fsdp_shards=k)).total for k in (1, 2, 4, 8)]
    assert totals == sorted(totals, reverse=True)
    assert M.train_memory(shape, M.TrainMemoryConfig(checkpointing=True)).activations < \
        M.train_memory(shape, M.TrainMemoryConfig(checkpointing=False)).activations
