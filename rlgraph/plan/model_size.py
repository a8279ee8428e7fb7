"""Model shapes from HF configs: parameter counts, FLOPs per token, KV-cache bytes per token."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch


@attrs.frozen
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tie_embeddings: bool = False
    qkv_bias: bool = False
    value_head: bool = False

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | Any) -> ModelShape:
        get = config.get if isinstance(config, Mapping) else lambda key, default=None: getattr(config, key, default)
        missing = [key for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size") if get(key) is None]
        if missing:
            raise ValueError(f"model config lacks {', '.join(missing)}; need a Llama/Qwen2/Mistral-style config")
        heads = get("num_attention_heads")
        return cls(
            hidden=get("hidden_size"), layers=get("num_hidden_layers"), heads=heads,
            kv_heads=get("num_key_value_heads") or heads, head_dim=get("head_dim") or get("hidden_size") // heads,
            intermediate=get("intermediate_size"), vocab=get("vocab_size"),
            tie_embeddings=bool(get("tie_word_embeddings", False)),
            qkv_bias=get("model_type") == "qwen2" or bool(get("attention_bias", False)),
        )

    @property
    def n_params(self) -> int:
        """Exact for Llama/Qwen2 decoders: embeddings, attention, SwiGLU MLP, RMSNorms, LM head."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = self.hidden * q + 2 * self.hidden * kv + q * self.hidden + ((q + 2 * kv) if self.qkv_bias else 0)
        mlp = 3 * self.hidden * self.intermediate
        per_layer = attention + mlp + 2 * self.hidden
        embeddings = self.vocab * self.hidden * (1 if self.tie_embeddings else 2)
        return self.layers * per_layer + embeddings + self.hidden + (self.hidden + 1 if self.value_head else 0)

    def flops_per_token(self, seq_len: int, *, training: bool) -> float:
        """Forward ~ 2 * params + 4 * layers * seq * hidden (attention scores and values); training = 3x."""
        forward = 2 * self.n_params + 4 * self.layers * seq_len * self.heads * self.head_dim
        return float(3 * forward if training else forward)

    def kv_cache_bytes_per_token(self, dtype: torch.dtype = torch.bfloat16) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * torch.empty((), dtype=dtype).element_size()
