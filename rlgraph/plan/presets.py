"""Well-known public model configs, by name, for plans of models far larger than this machine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_ASSETS = Path(__file__).resolve().parent.parent / "assets"

PRESETS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
    "llama3-8b": dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False),
    "llama3-70b": dict(model_type="llama", hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                       num_key_value_heads=8, intermediate_size=28672, vocab_size=128256, tie_word_embeddings=False),
}


def get_preset(name: str) -> dict[str, Any]:
    if name == "tiny-qwen2":
        return json.loads((_ASSETS / "tiny_qwen2.json").read_text())
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: tiny-qwen2, {', '.join(sorted(PRESETS))}")
    return dict(PRESETS[name])


def load_model_config(source: str | Path) -> dict[str, Any]:
    """A preset name, a config.json path, or a directory holding config.json."""
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" and path.exists():
        return json.loads(path.read_text())
    if str(source).endswith(".json"):
        raise ValueError(f"model config {source} does not exist")
    return get_preset(str(source))
