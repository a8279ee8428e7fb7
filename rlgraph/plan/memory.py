"""Per-rank memory estimates for training (FSDP2), generation (KV cache) and inference.

Formulas (bytes per rank):
- parameters / gradients: n_params * dtype / fsdp_shards; AdamW: two fp32 moments / shards;
  mixed precision adds fp32 master weights / shards; FSDP all-gathers one layer at a time
  (workspace = one unsharded layer).
- activations per token per layer: ~34 * hidden bytes (bf16, no recomputation; Korthikanti et
  al. 2022, without the attention-score term that flash attention removes) scaled to the dtype;
  with activation checkpointing only the layer inputs stay: 2 * hidden * dtype bytes per token
  per layer, plus one layer's full activations during recomputation.
- log-prob head: one chunk of [chunk_tokens, V] fp32 logits (the chunked head never holds more).
- generation: weights / tp + KV cache (sequences * seq_len * kv bytes per token / tp).
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import torch

from rlgraph.plan.model_size import ModelShape

LOGIT_CHUNK_TOKENS = 1024


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@attrs.frozen
class MemoryBreakdown:
    params: int = 0
    grads: int = 0
    optimizer: int = 0
    master_weights: int = 0
    activations: int = 0
    logits: int = 0
    kv_cache: int = 0
    workspace: int = 0

    @property
    def total(self) -> int:
        return sum(attrs.astuple(self))

    def as_dict(self) -> dict[str, int]:
        return {**attrs.asdict(self), "total": self.total}

    def __str__(self) -> str:
        parts = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in attrs.asdict(self).items() if v)
        return f"{self.total / 2**30:.2f} GiB ({parts})"


@attrs.frozen
class TrainMemoryConfig:
    param_dtype: torch.dtype = torch.bfloat16
    mixed_precision: bool = True
    fsdp_shards: int = 1
    checkpointing: bool = True
    micro_batch_tokens: int = 4096
    seq_len: int = 1024
    offload: bool = False


def train_memory(shape: ModelShape, cfg: TrainMemoryConfig) -> MemoryBreakdown:
    size, shards, n = _size(cfg.param_dtype), cfg.fsdp_shards, shape.n_params
    per_token_layer = 2 * shape.hidden * size if cfg.checkpointing else 17 * shape.hidden * size
    layer_params = n // max(shape.layers, 1)
    recompute = 17 * shape.hidden * size * cfg.micro_batch_tokens if cfg.checkpointing else 0
    return MemoryBreakdown(
        params=n * size // shards,
        grads=n * size // shards,
        optimizer=0 if cfg.offload else 2 * 4 * n // shards,
        master_weights=4 * n // shards if cfg.mixed_precision else 0,
        activations=per_token_layer * shape.layers * cfg.micro_batch_tokens + recompute,
        logits=2 * 4 * min(cfg.micro_batch_tokens, LOGIT_CHUNK_TOKENS) * shape.vocab,
        workspace=layer_params * size if shards > 1 else 0,
    )


def generate_memory(shape: ModelShape, *, tp: int, batch_sequences: int, max_seq_len: int,
                    dtype: torch.dtype = torch.bfloat16) -> MemoryBreakdown:
    return MemoryBreakdown(
        params=shape.n_params * _size(dtype) // tp,
        kv_cache=batch_sequences * max_seq_len * shape.kv_cache_bytes_per_token(dtype) // tp,
        logits=4 * batch_sequences * shape.vocab,
    )


def infer_memory(shape: ModelShape, *, batch_tokens: int, dtype: torch.dtype = torch.bfloat16, shards: int = 1) -> MemoryBreakdown:
    return MemoryBreakdown(
        params=shape.n_params * _size(dtype) // shards,
        activations=4 * shape.hidden * _size(dtype) * min(batch_tokens, 8192),
        logits=4 * min(batch_tokens, LOGIT_CHUNK_TOKENS) * shape.vocab,
    )


def colocated_peak(phases: Mapping[str, MemoryBreakdown], *, offload: bool) -> MemoryBreakdown:
    """Roles time-sharing ranks. Persistent: params (and, without offload, grads, optimizer and
    master weights of every trainer). Transient (activations, logits, KV cache, workspace): only
    the largest phase's at a time. With offload the trainer state leaves during other phases."""
    persistent = MemoryBreakdown()
    transient = MemoryBreakdown()
    for breakdown in phases.values():
        keep = dict(params=breakdown.params)
        if not offload:
            keep.update(grads=breakdown.grads, optimizer=breakdown.optimizer, master_weights=breakdown.master_weights)
        persistent = _add(persistent, MemoryBreakdown(**keep))
        moving = attrs.evolve(breakdown, params=0, **({} if offload else dict(grads=0, optimizer=0, master_weights=0)))
        if moving.total > transient.total:
            transient = moving
    return _add(persistent, transient)


def _add(a: MemoryBreakdown, b: MemoryBreakdown) -> MemoryBreakdown:
    return MemoryBreakdown(*(x + y for x, y in zip(attrs.astuple(a), attrs.astuple(b))))


class PlacementError(ValueError):
    """A role does not fit on its ranks."""


def check_fits(role: str, rank: int, need: MemoryBreakdown, capacity_bytes: int) -> None:
    if need.total <= capacity_bytes:
        return
    raise PlacementError(
        f"role {role} does not fit on rank {rank}: it needs {need} but the device has "
        f"{capacity_bytes / 2**30:.1f} GiB.\n  fix: shard further (more FSDP ranks), enable activation checkpointing, "
        "offload optimizer state (rg.colocated(offload=True)), use a smaller micro-batch, or more tensor parallelism for generation"
    )
