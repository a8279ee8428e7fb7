"""Well-known public model configs by name, to plan for models far larger than this machine.

    load_model_config("llama3-70b")           # a preset
    load_model_config("ckpt/config.json")     # a config file
    load_model_config("ckpt/")                # a directory holding config.json

The presets copy the architecture fields of the models' published `config.json`; nothing is
downloaded. `tiny-qwen2-vl` is the shipped tiny Qwen2-VL (`rlgraph/backends/local/vlm.py`).
`tiny-qwen2` is the ~126k-parameter model the tests and the CPU demo build.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlgraph.plan.model_size import ModelShape

_TINY_QWEN2 = Path(__file__).resolve().parent.parent / "assets" / "tiny_qwen2.json"
_SHIPPED = {"tiny-qwen2": _TINY_QWEN2, "tiny-qwen2-vl": _TINY_QWEN2.with_name("tiny_qwen2_vl.json")}


def _qwen2(**fields: Any) -> dict[str, Any]:
    base = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_act="silu", rms_norm_eps=1e-6,
                rope_theta=1_000_000.0, use_sliding_window=False, attention_dropout=0.0)
    return {**base, **fields}


def _llama3(**fields: Any) -> dict[str, Any]:
    return dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu", rms_norm_eps=1e-5,
                rope_theta=500_000.0, max_position_embeddings=8192, vocab_size=128256, tie_word_embeddings=False,
                attention_bias=False, mlp_bias=False, num_key_value_heads=8, head_dim=128, **fields)


PRESETS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": _qwen2(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                           intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
                           max_position_embeddings=32768),
    "qwen2.5-1.5b": _qwen2(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                           intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True,
                           max_position_embeddings=32768),
    "qwen2.5-7b": _qwen2(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                         intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False,
                         max_position_embeddings=131072),
    # Qwen/Qwen2.5-VL-7B-Instruct's config.json: the language model's fields at the top level, as published
    "qwen2.5-vl-7b": _qwen2(
        model_type="qwen2_5_vl", architectures=["Qwen2_5_VLForConditionalGeneration"], hidden_size=3584,
        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944,
        vocab_size=152064, tie_word_embeddings=False, max_position_embeddings=128000,
        rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}, bos_token_id=151643, eos_token_id=151645,
        vision_start_token_id=151652, vision_end_token_id=151653, image_token_id=151655, video_token_id=151656,
        vision_config={"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                       "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
                       "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                       "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2}),
    "llama3-8b": _llama3(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, intermediate_size=14336),
    "llama3-70b": _llama3(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, intermediate_size=28672),
}


def preset_names() -> list[str]:
    """Every name `get_preset` accepts."""
    return [name for name, path in _SHIPPED.items() if path.is_file()] + sorted(PRESETS)


def get_preset(name: str) -> dict[str, Any]:
    """A fresh copy of the named config dict."""
    if name in _SHIPPED and _SHIPPED[name].is_file():
        return json.loads(_SHIPPED[name].read_text())
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(preset_names())}. "
                         "Or pass a config.json path or a directory holding one")
    return json.loads(json.dumps(PRESETS[name]))


DEFAULT_MODEL = "tiny-qwen2"  # the model a compile that names none is planned for


def role_model_shape(models: Mapping[str, Any], role: str) -> ModelShape:
    """The shape of `role`'s model in a compile's `models` (a config dict, a preset name or a path;
    a role not named has the policy's, and a compile naming none `DEFAULT_MODEL`)."""
    source = models.get(role) or models.get("policy") or DEFAULT_MODEL
    return ModelShape.from_hf_config(source if isinstance(source, dict) else load_model_config(source))


def load_model_config(source: str | Path) -> dict[str, Any]:
    """A preset name, a `config.json` path, or a directory holding `config.json`."""
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ValueError(f"model directory {str(source)!r} has no config.json")
    if path.is_file():
        try:
            config = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"model config {str(path)!r} is not valid JSON: {error}") from None
        if not isinstance(config, dict):
            raise ValueError(f"model config {str(path)!r} holds a {type(config).__name__}, not a JSON object")
        return config
    if isinstance(source, Path) or path.suffix == ".json" or "/" in str(source):
        raise ValueError(f"model config {str(source)!r} does not exist; give a preset "
                         f"({', '.join(preset_names())}), a config.json path or a directory holding one")
    return get_preset(str(source))
