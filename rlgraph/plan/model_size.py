"""Decoder shapes from HF configs: exact parameter counts, FLOPs per token, KV-cache bytes per token.

    shape = ModelShape.from_hf_config(load_model_config("llama3-8b"))
    shape.n_params                               # 8_030_261_248
    shape.flops_per_token(4096, training=True)   # ~5.1e10
    shape.kv_cache_bytes_per_token()             # 131_072 (bf16)

Covers the Llama / Qwen2 / Qwen3 / Mistral family: token embedding, `layers` x (RMSNorm,
attention with grouped-query heads and rotary positions, RMSNorm, SwiGLU MLP), final RMSNorm, and
an LM head (tied or not) or a scalar value head (a critic). Pure arithmetic, nothing is built.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from rlgraph.plan.vision_size import VISION_KINDS, VisionShape

_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
_MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")


def _positive(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if not (isinstance(value, int) and value >= 1):
        raise ValueError(f"ModelShape.{attribute.name} must be a positive int, got {value!r}")


@attrs.frozen
class LoraShape:
    """LoRA adapters of rank `r` on the linear modules named `target_modules` (`q_proj`, ...,
    `down_proj`, `lm_head`): what the memory model needs of a peft `LoraConfig`."""

    r: int = attrs.field(validator=_positive)
    target_modules: tuple[str, ...] = attrs.field(converter=tuple)

    def __str__(self) -> str:
        return f"r={self.r} on {','.join(self.target_modules)}"


def dtype_bytes(dtype: torch.dtype) -> int:
    """Bytes per element of `dtype` (`torch.bfloat16` -> 2)."""
    return dtype.itemsize


@attrs.frozen
class ModelShape:
    """The sizes that fix a decoder's parameters, FLOPs and KV cache.

    `qkv_bias`: biases on the q/k/v projections (Qwen2); `o_bias`: on the output projection (Llama
    with `attention_bias`); `mlp_bias`: on the three MLP projections; `qk_norm`: per-head RMSNorm
    of q and k (Qwen3); `value_head`: a scalar head with a bias replaces the LM head (a critic, as
    HF's `*ForTokenClassification(num_labels=1)`).
    """

    hidden: int = attrs.field(validator=_positive)
    layers: int = attrs.field(validator=_positive)
    heads: int = attrs.field(validator=_positive)
    kv_heads: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(validator=_positive)
    intermediate: int = attrs.field(validator=_positive)
    vocab: int = attrs.field(validator=_positive)
    tie_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    value_head: bool = False
    vision: VisionShape | None = None  # a vision-language model's tower (Qwen2-VL, Qwen2.5-VL)
    train_vision: bool = False  # whether the tower trains (frozen by default, as rlgraph builds it)

    def __attrs_post_init__(self) -> None:
        if self.heads % self.kv_heads:
            raise ValueError(f"ModelShape: {self.heads} attention heads are not a multiple of {self.kv_heads} kv heads")

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | Any, *, value_head: bool = False) -> ModelShape:
        """From a `config.json` dict or a `transformers.PretrainedConfig` of a Llama/Qwen2/Qwen3/Mistral model."""
        if not isinstance(config, Mapping):
            config = config.to_dict() if hasattr(config, "to_dict") else vars(config)
        kind = config.get("model_type", "unknown")
        vision = VisionShape.from_hf_config(config) if kind in VISION_KINDS else None
        if vision is not None:  # the language model's fields: top level (published configs) or text_config
            config = {**config, **(config.get("text_config") or {}), "model_type": kind}
        missing = [key for key in _REQUIRED if config.get(key) is None]
        if missing:
            raise ValueError(
                f"model config (model_type={kind!r}) lacks {', '.join(missing)}; rlgraph's memory model needs a "
                f"Llama/Qwen2/Mistral-style config.json with {', '.join(_REQUIRED)}"
            )
        if any(config.get(key) for key in _MOE_FIELDS):
            raise ValueError(f"model config (model_type={kind!r}) is a mixture of experts, which the memory model "
                             "does not size; give a dense Llama/Qwen2/Mistral-style config")
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        head_dim = config.get("head_dim")
        if head_dim is None:
            if hidden % heads:
                raise ValueError(f"model config (model_type={kind!r}): hidden_size={hidden} is not divisible by "
                                 f"num_attention_heads={heads}; give head_dim")
            head_dim = hidden // heads
        attention_bias = bool(config.get("attention_bias", False))
        return cls(
            hidden=hidden, layers=config["num_hidden_layers"], heads=heads,
            kv_heads=config.get("num_key_value_heads") or heads, head_dim=head_dim,
            intermediate=config["intermediate_size"], vocab=config["vocab_size"],
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=kind in ("qwen2", *VISION_KINDS) or attention_bias, o_bias=attention_bias,
            mlp_bias=bool(config.get("mlp_bias", False)), qk_norm=kind == "qwen3", value_head=value_head,
            vision=vision,
        )

    # -- sizes -------------------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """One decoder layer: q/k/v/o projections (+ biases), SwiGLU MLP (+ biases), two RMSNorms."""
        h, q, kv, inter = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        attention = 2 * h * q + 2 * h * kv + (q + 2 * kv if self.qkv_bias else 0) + (h if self.o_bias else 0)
        attention += 2 * self.head_dim if self.qk_norm else 0
        mlp = 3 * h * inter + (2 * inter + h if self.mlp_bias else 0)
        return attention + mlp + 2 * h

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def head_params(self) -> int:
        """The output head: a scalar value head with bias, nothing when tied, else a [V, H] matrix."""
        if self.value_head:
            return self.hidden + 1
        return 0 if self.tie_embeddings else self.vocab * self.hidden

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each named linear of a decoder layer, and of the LM head."""
        h, q, kv, inter = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        layer = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                 "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
        return layer if self.value_head else {**layer, "lm_head": (h, self.vocab)}

    def lora_params(self, lora: LoraShape) -> int:
        """Adapter parameters: r * (in + out) per wrapped linear (A is [r, in], B is [out, r]), in
        every layer (the LM head once). A name that is no linear here raises ValueError."""
        shapes = self.linear_shapes()
        unknown = [name for name in lora.target_modules if name not in shapes]
        if unknown:
            raise ValueError(f"LoRA target {unknown[0]!r} is no linear module of this model; it has {', '.join(shapes)}")
        return sum(lora.r * sum(shapes[name]) * (1 if name == "lm_head" else self.layers) for name in set(lora.target_modules))

    @property
    def n_params(self) -> int:
        """Exact for HF Llama/Qwen2/Qwen3/Mistral and Qwen2(.5)-VL (`sum(p.numel() for p in model.parameters())`)."""
        return self.text_params + (self.vision.n_params if self.vision is not None else 0)

    @property
    def text_params(self) -> int:
        """The language model's parameters (all of them for a text-only model)."""
        return self.embedding_params + self.layers * self.layer_params + self.hidden + self.head_params

    @property
    def trainable_params(self) -> int:
        """Parameters a full fine-tune trains: all but a frozen vision tower."""
        frozen = self.vision.n_params if self.vision is not None and not self.train_vision else 0
        return self.n_params - frozen

    @property
    def largest_unit_params(self) -> int:
        """The largest FSDP unit when each decoder layer is one unit and the embedding another."""
        return max(self.layer_params, self.embedding_params, self.head_params)

    def flops_per_token(self, seq_len: int, *, training: bool, recompute: bool = False) -> float:
        """Matmul FLOPs per token with `seq_len` tokens of context.

        forward = 2 * (matmul parameters) + 4 * layers * seq_len * q_dim
        The first term is one multiply-add per weight (the input embedding is a lookup, not a
        matmul; tied embeddings still count once, for the head); the second is QK^T and AV over
        the full [seq, seq] score matrix, as PaLM (Chowdhery et al. 2022, App. B) and Megatron
        (Narayanan et al. 2021) count it; causal kernels skip about half of it. Training is 3x the
        forward (backward = 2x), 4x with activation recomputation.
        """
        # text tokens only: a vision tower's FLOPs are per image (`VisionShape.flops_per_image`)
        tied_head = self.embedding_params if self.tie_embeddings and not self.value_head else 0
        matmul_params = self.text_params - self.embedding_params + tied_head
        forward = 2 * matmul_params + 4 * self.layers * seq_len * self.q_dim
        return float(forward * ((4 if recompute else 3) if training else 1))

    def kv_cache_bytes_per_token(self, dtype: torch.dtype = torch.bfloat16) -> int:
        """K and V of every layer for one token: 2 * layers * kv_heads * head_dim * element size."""
        return 2 * self.layers * self.kv_dim * dtype_bytes(dtype)
