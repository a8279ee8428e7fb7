"""Per-rank memory of training (FSDP2 + AdamW), generation (KV cache) and forward-only inference.

    shape = ModelShape.from_hf_config(load_model_config("llama3-8b"))
    need = train_memory(shape, TrainMemoryConfig(fsdp_shards=8, micro_batch_tokens=8192))
    print(need)                                  # 23.06 GiB (params 1.87 GiB, grads 1.87 GiB, ...)
    check_fits("policy", 0, need, Mesh("h100").capacity_bytes)   # rlgraph.plan.mesh: the hardware table

Every estimate is a `MemoryBreakdown` of named byte counts at the phase's peak. The formulas, the
sources of their constants and the measured check against a real run are in docs/memory-model.md;
the activation constants follow the Hugging Face Llama/Qwen2 decoder layer that rlgraph trains.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch

from rlgraph.lora_layout import shares_lora_base
from rlgraph.plan.model_size import LoraShape, ModelShape, dtype_bytes

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
# Tokens per chunk of rlgraph's log-prob head (`rlgraph.kernels.logprob_head.DEFAULT_CHUNK`;
# repeated here because `plan` may not import `kernels`).
LOGIT_CHUNK_TOKENS = 1024
# Prompt tokens a generation engine prefills at once: vLLM's chunked-prefill budget.
PREFILL_CHUNK_TOKENS = 8192

PERSISTENT = ("params", "grads", "optimizer", "master_weights", "kv_cache")
TRANSIENT = ("activations", "logits", "workspace")
PARKED = ("grads", "optimizer", "master_weights")  # what an offload step between colocated phases moves to host memory


def format_bytes(n: int) -> str:
    """`1.50 GiB`, `12.0 MiB`, `3.0 KiB`, `12 B`."""
    if n >= GiB:
        return f"{n / GiB:.2f} GiB"
    if n >= MiB:
        return f"{n / MiB:.1f} MiB"
    return f"{n / KiB:.1f} KiB" if n >= KiB else f"{n} B"


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@attrs.frozen
class MemoryBreakdown:
    """Bytes one rank holds at a phase's peak, by purpose.

    params / grads: model weights and their gradients in the compute dtype (this rank's shard);
    optimizer: AdamW's two moments; master_weights: fp32 copy kept under mixed precision;
    activations: tensors saved for backward (or a forward's working set); logits: one chunk of
    [tokens, V] fp32 logits; kv_cache: generation K/V; workspace: transient buffers (FSDP
    all-gathers, gradients of activations, optimizer-step temporaries, growing KV-cache copies).
    """

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
        """Every part and `total`, in bytes (what `Plan.memory` stores)."""
        return {**attrs.asdict(self), "total": self.total}

    def __add__(self, other: MemoryBreakdown) -> MemoryBreakdown:
        return MemoryBreakdown(*(a + b for a, b in zip(attrs.astuple(self), attrs.astuple(other))))

    def persistent(self) -> MemoryBreakdown:
        """The parts that outlive a phase unless offloaded: weights, gradients, optimizer state, KV-cache pool."""
        return MemoryBreakdown(**{name: getattr(self, name) for name in PERSISTENT})

    def transient(self) -> MemoryBreakdown:
        """The parts freed when the phase ends: activations, logits, workspace."""
        return MemoryBreakdown(**{name: getattr(self, name) for name in TRANSIENT})

    def parked(self) -> MemoryBreakdown:
        """The parts an offload step between colocated phases moves off the device: gradients,
        optimizer state, master weights."""
        return MemoryBreakdown(**{name: getattr(self, name) for name in PARKED})

    @staticmethod
    def sum(parts: Iterable[MemoryBreakdown]) -> MemoryBreakdown:
        out = MemoryBreakdown()
        for part in parts:
            out = out + part
        return out

    @staticmethod
    def largest(parts: Iterable[MemoryBreakdown]) -> MemoryBreakdown:
        """The breakdown with the largest total (an empty iterable gives zeros)."""
        return max(parts, key=lambda part: part.total, default=MemoryBreakdown())

    def __str__(self) -> str:
        parts = ", ".join(f"{name.replace('_', ' ')} {format_bytes(value)}" for name, value in attrs.asdict(self).items() if value)
        return f"{format_bytes(self.total)} ({parts or 'nothing'})"


# -- per-token constants ------------------------------------------------------------------------
def layer_activation_bytes(shape: ModelShape, dtype: torch.dtype, *, seq_len: int = 0, fused_attention: bool = True) -> int:
    """Bytes one decoder layer saves for backward, per token, without recomputation.

    Counted from the tensors autograd keeps in the HF Llama/Qwen2 layer (e = element size):
      2 RMSNorms  2 * (4h + 4 + 2eh)  fp32 input and rsqrt, normalized and scaled outputs
      attention   e * 4 * q_dim       rotated q, k and v repeated to the query heads, output
                  + 4 * heads         fp32 log-sum-exp of the fused (SDPA / flash) kernel
                  + (4 + e) * heads * seq_len   only if the scores are materialized (4 in fp32)
      SwiGLU MLP  4e * intermediate   gate, up, silu(gate), silu(gate) * up
    This is Korthikanti et al. (2022)'s 34h + 5*heads*seq per layer, redone for RMSNorm, GQA,
    rotary positions and SwiGLU; at Llama-3-8B's sizes in bf16 it is ~52h.
    """
    e, h = dtype_bytes(dtype), shape.hidden
    norms = 2 * (4 * h + 4 + 2 * e * h)
    attention = 4 * e * shape.q_dim + 4 * shape.heads
    if not fused_attention:  # fp32 softmax output, and its cast to the compute dtype unless that is fp32
        attention += (4 + (e if e != 4 else 0)) * shape.heads * seq_len
    return norms + attention + 4 * e * shape.intermediate


def head_activation_bytes(shape: ModelShape, dtype: torch.dtype) -> int:
    """Per token, outside the layers: final RMSNorm, the head's input rows, rotary cos/sin."""
    e, h = dtype_bytes(dtype), shape.hidden
    return (4 * h + 4 + 2 * e * h) + e * h + 2 * e * shape.head_dim


def backward_transient_bytes(shape: ModelShape, dtype: torch.dtype) -> int:
    """Per token, the gradients of activations alive at once in a layer's backward (the SwiGLU
    MLP's: of its product, gate and up projections, and the residual stream)."""
    return dtype_bytes(dtype) * (3 * shape.intermediate + shape.hidden)


def forward_working_bytes(shape: ModelShape, dtype: torch.dtype) -> int:
    """Per token, a forward without autograd at its widest point (the MLP): residual stream,
    normalized input, silu(gate), up and their product."""
    return dtype_bytes(dtype) * (2 * shape.hidden + 3 * shape.intermediate)


# -- training -----------------------------------------------------------------------------------
def _at_least_one(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if not (isinstance(value, int) and value >= 1):
        raise ValueError(f"TrainMemoryConfig.{attribute.name} must be an int >= 1, got {value!r}")


@attrs.frozen
class TrainMemoryConfig:
    """How a role trains on one rank.

    `param_dtype` is the compute dtype of weights, gradients and activations; `mixed_precision`
    keeps fp32 master weights and fp32 AdamW moments beside bf16/fp16 weights (without it the
    moments take the parameter dtype, as `torch.optim.AdamW` does). `fsdp_shards` ranks share
    parameters, gradients and optimizer state. `offload_optimizer` keeps AdamW state and master
    weights in host memory (the step runs there); `offload_params` keeps sharded parameters and
    gradients there too, leaving only the all-gathered units (and the shards copied in for their
    all-gather) on the device; both together are FSDP2's `CPUOffloadPolicy` (`train_host_memory`
    is what the host then holds). `fused_attention`:
    SDPA / flash attention, which never holds the [seq, seq] scores; `fused_optimizer`:
    `AdamW(fused=True)`, which needs no parameter-sized temporary (torch's default is `foreach`).
    `lora`: train LoRA adapters over a frozen base (`lora_state`): the base weights are held in
    `param_dtype` only; gradients, AdamW moments and master weights are the adapters'.
    `unsharded_grads`: gradients accumulate unsharded over the micro-batches and are reduce-scattered
    once per optimizer step (`TrainLayout.grad_sync_last`); each rank then also holds the trained
    parameters' full gradient, in fp32 under mixed precision (FSDP2 upcasts it to the reduce dtype).
    """

    param_dtype: torch.dtype = torch.bfloat16
    mixed_precision: bool = True
    fsdp_shards: int = attrs.field(default=1, validator=_at_least_one)
    checkpointing: bool = True
    micro_batch_tokens: int = attrs.field(default=4096, validator=_at_least_one)
    seq_len: int = attrs.field(default=1024, validator=_at_least_one)
    offload_optimizer: bool = False
    offload_params: bool = False
    fused_attention: bool = True
    fused_optimizer: bool = False
    logit_chunk_tokens: int = attrs.field(default=LOGIT_CHUNK_TOKENS, validator=_at_least_one)
    lora: LoraShape | None = None
    unsharded_grads: bool = False

    @classmethod
    def for_device(cls, device: str, **overrides: object) -> TrainMemoryConfig:
        """fp32 without master weights on `cpu`, bf16 with fp32 master weights on accelerators."""
        defaults = dict(param_dtype=torch.float32, mixed_precision=False) if device == "cpu" else {}
        return cls(**{**defaults, **overrides})

    @property
    def has_master_weights(self) -> bool:
        return self.mixed_precision and dtype_bytes(self.param_dtype) < 4


def train_memory(shape: ModelShape, cfg: TrainMemoryConfig) -> MemoryBreakdown:
    """Per-rank peak of training one micro-batch: the breakdown at the largest of three moments.

    State at every moment (divided by `fsdp_shards`): params and grads n*e, AdamW's 2 moments,
    fp32 master weights n*4. On top of it:
      head backward   every layer's saved activations, the head's own, three [chunk, V] fp32
                      buffers and the fp32 [V, H] weight gradient of the chunked log-prob head
      layer backward  every layer's saved activations (+ one recomputed layer when
                      checkpointing) and the gradients of one layer's activations
      optimizer step  one parameter-sized temporary of `foreach` AdamW (none when fused)
    With FSDP both backward moments also hold two all-gathered units and one unit's gradients
    (and, with `unsharded_grads`, the whole accumulated gradient, until the last micro-batch's reduce-scatter);
    offloaded, also those units' shards copied in from the host and one unit's sharded gradients
    on their way back. What is offloaded is 0 here (`train_host_memory` counts it).
    """
    e, shards, tokens = dtype_bytes(cfg.param_dtype), cfg.fsdp_shards, cfg.micro_batch_tokens
    state, _ = _split_state(shape, cfg)
    per_layer = layer_activation_bytes(shape, cfg.param_dtype, seq_len=cfg.seq_len, fused_attention=cfg.fused_attention)
    per_layer += lora_activation_bytes(shape, cfg.lora, cfg.param_dtype)
    # Checkpointing keeps only each layer's input and recomputes one layer at a time in backward.
    stored = tokens * shape.layers * (e * shape.hidden if cfg.checkpointing else per_layer)
    # Under LoRA a unit's gradients are its adapters' (counted in the state), not a unit's worth.
    gathered = _fsdp_gather_bytes(shape, e, grads=cfg.lora is None) if shards > 1 or cfg.offload_params else 0
    if cfg.unsharded_grads:  # the accumulated full gradient: alive through the backwards, freed by the reduce-scatter
        gathered += trainable_params(shape, cfg) * (4 if cfg.has_master_weights else e)
    if cfg.offload_params:
        shard_bytes = 4 if cfg.has_master_weights else e  # FSDP2 keeps fp32 shards and reduces in fp32 under mixed precision
        gathered += _offload_staging_bytes(shape, shards, shard_bytes, units=3)  # 2 units' parameter shards, 1 unit's gradients
    head_backward = state + MemoryBreakdown(
        activations=stored + tokens * head_activation_bytes(shape, cfg.param_dtype),
        logits=0 if shape.value_head else 3 * 4 * min(tokens, cfg.logit_chunk_tokens) * shape.vocab,
        workspace=gathered + _head_weight_bytes(shape, cfg),
    )
    layer_backward = state + MemoryBreakdown(
        activations=stored + (tokens * per_layer if cfg.checkpointing else 0),
        workspace=gathered + tokens * backward_transient_bytes(shape, cfg.param_dtype),
    )
    step = state + MemoryBreakdown(workspace=0 if cfg.offload_optimizer else _step_temporary_bytes(shape, cfg))
    return MemoryBreakdown.largest([head_backward, layer_backward, step])


def _head_weight_bytes(shape: ModelShape, cfg: TrainMemoryConfig) -> int:
    """The chunked log-prob head's [V, H] fp32 buffer in its backward: the fp32 weight gradient it
    accumulates, or the fp32 copy of a 16-bit weight. None for a value head, nor for a frozen fp32
    head (LoRA without `lm_head` in fp32: `weight.float()` is the weight itself and no gradient is asked)."""
    frozen = cfg.lora is not None and "lm_head" not in cfg.lora.target_modules
    if shape.value_head or (frozen and dtype_bytes(cfg.param_dtype) == 4):
        return 0
    return 4 * shape.vocab * shape.hidden


# -- packed sequences ---------------------------------------------------------------------------
def packed_mask_bytes(tokens: int, dtype: torch.dtype) -> int:
    """The block-diagonal mask of a packed micro-batch of `tokens` real tokens: the [L, L] bool
    mask the model is given, and the additive [L, L] mask SDPA converts it to in the compute dtype
    (`scaled_dot_product_attention` does so for a bool mask on every backend). Both live through
    the forward and backward (autograd keeps the mask for the attention's backward)."""
    return tokens * tokens * (1 + dtype_bytes(dtype))


def packed_train_memory(shape: ModelShape, cfg: TrainMemoryConfig) -> MemoryBreakdown:
    """`train_memory` of one packed micro-batch of `cfg.micro_batch_tokens` real tokens (no padding).

    Activations are per token, so a packed micro-batch holds its real tokens' (L), not rows x the
    longest row's; an attention that materialises the scores (`fused_attention=False`) sees L keys
    per query (the mask spans the micro-batch), so `seq_len` is L; plus the mask (`packed_mask_bytes`).

    >>> from rlgraph.plan.presets import load_model_config
    >>> shape = ModelShape.from_hf_config(load_model_config("qwen2.5-0.5b"))
    >>> padded = train_memory(shape, TrainMemoryConfig(micro_batch_tokens=8 * 1024, seq_len=1024))
    >>> packed = packed_train_memory(shape, TrainMemoryConfig(micro_batch_tokens=4096, seq_len=1024))
    >>> packed.activations < padded.activations
    True
    """
    tokens = cfg.micro_batch_tokens
    mask = MemoryBreakdown(activations=packed_mask_bytes(tokens, cfg.param_dtype))
    return train_memory(shape, attrs.evolve(cfg, seq_len=tokens)) + mask


def train_host_memory(shape: ModelShape, cfg: TrainMemoryConfig) -> MemoryBreakdown:
    """Per rank, the host memory the offloaded training state takes: the parts `train_memory`
    leaves off the device (sharded params and grads with `offload_params`, AdamW's moments and
    the master weights with `offload_optimizer`), plus the optimizer step's temporary, since the
    step then runs on the CPU. With FSDP2's `CPUOffloadPolicy` (both flags) this is the whole
    training state, ZeRO's 16 bytes per parameter under mixed precision, divided by the shards.
    """
    _, host = _split_state(shape, cfg)
    return host + MemoryBreakdown(workspace=_step_temporary_bytes(shape, cfg) if cfg.offload_optimizer else 0)


def trainable_params(shape: ModelShape, cfg: TrainMemoryConfig) -> int:
    """Parameters with gradients and optimizer state: all but a frozen vision tower, or the LoRA adapters'."""
    return shape.trainable_params if cfg.lora is None else shape.lora_params(cfg.lora)


def lora_activation_bytes(shape: ModelShape, lora: LoraShape | None, dtype: torch.dtype) -> int:
    """Per token per layer, what LoRA adds to a layer's saved activations: each adapter's [r]
    intermediate A x, kept for B's gradient (A's input is the base linear's, saved already)."""
    if lora is None:
        return 0
    return dtype_bytes(dtype) * lora.r * len(set(lora.target_modules) - {"lm_head"})


def _split_state(shape: ModelShape, cfg: TrainMemoryConfig) -> tuple[MemoryBreakdown, MemoryBreakdown]:
    """The training state of one rank (1/fsdp_shards of: params and grads n*e, AdamW's two moments,
    fp32 master weights n*4), as (on the device, in host memory) by the config's offload flags.
    Under LoRA with a adapter parameters: params (n + a)*e (the frozen base is held in the compute
    dtype, with no master copy), grads a*e, moments 2*4*a (mixed precision) and master weights 4*a."""
    e, shards = dtype_bytes(cfg.param_dtype), cfg.fsdp_shards
    trained = trainable_params(shape, cfg)
    held = shape.n_params + (trained if cfg.lora is not None else 0)
    moment_bytes = 4 if cfg.has_master_weights else e
    weights = MemoryBreakdown(params=_ceil_div(held * e, shards), grads=_ceil_div(trained * e, shards))
    optimizer = MemoryBreakdown(optimizer=_ceil_div(2 * moment_bytes * trained, shards),
                                master_weights=_ceil_div(4 * trained, shards) if cfg.has_master_weights else 0)
    device = (MemoryBreakdown() if cfg.offload_params else weights) + (MemoryBreakdown() if cfg.offload_optimizer else optimizer)
    host = (weights if cfg.offload_params else MemoryBreakdown()) + (optimizer if cfg.offload_optimizer else MemoryBreakdown())
    return device, host


def _step_temporary_bytes(shape: ModelShape, cfg: TrainMemoryConfig) -> int:
    """One parameter-sized temporary of torch's default `foreach` AdamW (none when fused), per rank."""
    moment_bytes = 4 if cfg.has_master_weights else dtype_bytes(cfg.param_dtype)
    return 0 if cfg.fused_optimizer else _ceil_div(moment_bytes * trainable_params(shape, cfg), cfg.fsdp_shards)


def _offload_staging_bytes(shape: ModelShape, shards: int, shard_bytes: int, *, units: int) -> int:
    """Device copies of `units` of the largest unit's shards under FSDP2's CPUOffloadPolicy: a
    unit's parameter shards are copied host-to-device before its all-gather, its reduce-scattered
    gradient shards device-to-host after it."""
    return units * shard_bytes * _ceil_div(shape.largest_unit_params, shards)


def _fsdp_gather_bytes(shape: ModelShape, e: int, *, grads: bool) -> int:
    """FSDP2 holds the current unit and the prefetched next one unsharded (plus, in backward, the
    current unit's gradients before their reduce-scatter); the largest unit may be the embedding."""
    return e * (shape.largest_unit_params * (2 if grads else 1) + shape.layer_params)


# -- generation and inference ---------------------------------------------------------------
def generate_memory(shape: ModelShape, *, tp: int, batch_sequences: int, max_seq_len: int,
                    dtype: torch.dtype = torch.bfloat16, prompt_len: int | None = None) -> MemoryBreakdown:
    """Per-rank peak of a `tp`-way tensor-parallel engine generating `batch_sequences` at once.

    params n*e/tp; KV cache batch * max_seq_len * kv bytes per token / min(tp, kv_heads) (engines
    replicate KV heads when tp exceeds them); prefill activations of batch * prompt_len tokens
    (max_seq_len if not given; at most PREFILL_CHUNK_TOKENS) / tp; the sampler's fp32 logits,
    probabilities and log-softmax of every row; one layer's K/V copy as the cache grows.
    """
    if tp < 1 or batch_sequences < 1 or max_seq_len < 1:
        raise ValueError(f"generate_memory: tp, batch_sequences and max_seq_len must be >= 1, got "
                         f"{tp}, {batch_sequences}, {max_seq_len}")
    kv_cache = _ceil_div(batch_sequences * max_seq_len * shape.kv_cache_bytes_per_token(dtype), min(tp, shape.kv_heads))
    prefill = min(batch_sequences * (prompt_len or max_seq_len), PREFILL_CHUNK_TOKENS)
    return MemoryBreakdown(
        params=_ceil_div(shape.n_params * dtype_bytes(dtype), tp),
        kv_cache=kv_cache,
        activations=_ceil_div(prefill * forward_working_bytes(shape, dtype), tp),
        logits=3 * 4 * batch_sequences * shape.vocab,
        workspace=kv_cache // shape.layers,
    )


def rollout_memory(shape: ModelShape, *, tp: int, rows: int, prompt_len: int, max_total_tokens: int,
                   dtype: torch.dtype = torch.bfloat16) -> MemoryBreakdown:
    """Per-rank peak of a multi-turn rollout (`rg.rollout`) of `rows` episodes on a `tp`-way engine.

    Every row keeps its KV cache across turns (observations are appended to it, nothing is
    prefilled twice), so the cache holds rows x (prompt_len + max_total_tokens) tokens: the
    prompt, then every turn and observation of the response. The first block (prompt + first
    observation) is fed whole, unchunked: rows * prompt_len tokens of forward activations. The
    rest is `generate_memory`'s: sampler logits of every row, one layer's K/V copy as the cache grows.
    """
    if min(tp, rows, prompt_len, max_total_tokens) < 1:
        raise ValueError(f"rollout_memory: tp, rows, prompt_len and max_total_tokens must be >= 1, got "
                         f"{tp}, {rows}, {prompt_len}, {max_total_tokens}")
    decoding = generate_memory(shape, tp=tp, batch_sequences=rows, max_seq_len=prompt_len + max_total_tokens,
                               dtype=dtype, prompt_len=prompt_len)
    return attrs.evolve(decoding, activations=_ceil_div(rows * prompt_len * forward_working_bytes(shape, dtype), tp))


def infer_memory(shape: ModelShape, *, batch_tokens: int, dtype: torch.dtype = torch.bfloat16, shards: int = 1,
                 micro_batch_tokens: int | None = None, offload_params: bool = False,
                 shared_weights: bool = False) -> MemoryBreakdown:
    """Per-rank peak of a forward without gradients (reference / old-policy log-probs, values).

    params n*e/shards (FSDP: plus the current and prefetched units); the forward's working set and the
    final hidden states for the tokens processed at once (`micro_batch_tokens`, else all of
    `batch_tokens`); one chunk of fp32 logits and their exponentials. `offload_params` (a role under
    FSDP2's CPUOffloadPolicy): no parameters between units, the two gathered units and their shards
    copied in from the host instead. `shared_weights`: the forward reads weights another role holds
    on these ranks (the reference of a LoRA policy is the policy with its adapters off): params 0.
    """
    if batch_tokens < 1 or shards < 1:
        raise ValueError(f"infer_memory: batch_tokens and shards must be >= 1, got {batch_tokens}, {shards}")
    tokens = min(batch_tokens, micro_batch_tokens or batch_tokens)
    e = dtype_bytes(dtype)
    workspace = _fsdp_gather_bytes(shape, e, grads=False) if shards > 1 or offload_params else 0
    if offload_params:
        workspace += _offload_staging_bytes(shape, shards, 4, units=2)  # fp32 shards: the executor's mixed precision
    return MemoryBreakdown(
        params=0 if offload_params or shared_weights else _ceil_div(shape.n_params * e, shards),
        activations=tokens * (forward_working_bytes(shape, dtype) + e * shape.hidden),
        logits=0 if shape.value_head else 2 * 4 * min(tokens, LOGIT_CHUNK_TOKENS) * shape.vocab,
        workspace=workspace,
    )


def colocated_moments(phases: Mapping[str, MemoryBreakdown], *, offload: bool) -> dict[str, MemoryBreakdown]:
    """What ranks shared by several phases hold at each moment of a step, by moment.

    `phases` maps "role.phase" (or a bare phase name: one role) to that phase's own peak. Each
    moment is one phase running (named after it) plus what the other phases leave on the device:

    offload=False: nothing leaves, so every phase's persistent parts (weights, gradients, optimizer
    state, master weights, KV-cache pool) stay, and the running phase adds its transient parts.
    offload=True, as rlgraph's plans schedule it (`passes/schedule.py`, the FSDP2 executor's
    `offload`): only a role that both trains and generates takes turns. Its offload step parks the
    trainer's gradients, optimizer state and master weights while its generator runs (its
    parameters stay), and its generator (vLLM asleep) holds nothing outside its own turn. Every
    other trainer keeps its whole state resident (a critic through the policy's phases, the
    policy's onloaded state through the critic's update); a frozen role (reference, reward model)
    keeps its weights; a trainer's own forward (values, old log-probs) runs on the trainer's
    weights. One more moment, "role.sync_weights": the generator's weights are woken and loaded
    while every trainer's state is on the device. Pass each separate copy of the weights once: a
    phase that reuses another role's weights should come with params=0.
    """
    if not offload:
        persistent = MemoryBreakdown.sum(part.persistent() for part in phases.values())
        return {name: persistent + part.transient() for name, part in phases.items()}
    named = {name: _role_phase(name) for name in phases}
    trains = {role for role, phase in named.values() if phase == "train"}
    moments = {}
    for name, part in phases.items():
        role, phase = named[name]
        moments[name] = part + MemoryBreakdown.sum(_kept(phases[other], *named[other], role, phase, trains)
                                                   for other in phases if other != name)
    for name, part in phases.items():
        role, phase = named[name]
        if phase == "generate" and role in trains:
            moments[f"{role}.sync_weights" if "." in name else "sync_weights"] = MemoryBreakdown(params=part.params) + \
                MemoryBreakdown.sum(_kept(phases[other], *named[other], role, "sync_weights", trains)
                                    for other in phases if other != name)
    return moments


def _role_phase(name: str) -> tuple[str, str]:
    role, _, phase = name.rpartition(".")
    return role, phase


def _kept(part: MemoryBreakdown, role: str, phase: str, now_role: str, now_phase: str, trains: set[str]) -> MemoryBreakdown:
    """What `role`'s `phase` leaves on the device while `now_role`'s `now_phase` runs, under offload=True."""
    if phase == "generate":
        return MemoryBreakdown()  # the engine sleeps (vLLM) or frees its cache outside its turn and its sync
    if phase == "infer":
        return MemoryBreakdown() if role in trains else MemoryBreakdown(params=part.params)
    if phase == "train" and role == now_role and now_phase == "generate":
        return MemoryBreakdown(params=part.params)  # the offload step parked the rest
    if phase == "train" and role == now_role and now_phase == "infer":
        return attrs.evolve(part.persistent(), params=0)  # the forward's own figure holds these weights
    return part.persistent()


def colocated_peak(phases: Mapping[str, MemoryBreakdown], *, offload: bool) -> MemoryBreakdown:
    """Peak of phases time-sharing the same ranks: the largest of `colocated_moments`."""
    return MemoryBreakdown.largest(colocated_moments(phases, offload=offload).values())


# -- capacity and the fit check -------------------------------------------------------------
class PlacementError(ValueError):
    """A role does not fit in the memory of its ranks."""


_FIXES = {
    "state": "shard the training state over more ranks (more FSDP shards: rg.colocated(fsdp=...) or a larger group "
             "in rg.split), or keep parameters, gradients and optimizer state in host memory (cpu_offload=True)",
    "activations": "enable activation checkpointing (checkpointing=True) or use a smaller micro-batch (micro_batch_size=...)",
    "logits": "use a smaller log-prob chunk or fewer tokens per micro-batch",
    "kv_cache": "use more tensor parallelism for generation (tp=...), fewer sequences per generation batch, or shorter sequences",
    "workspace": "use a smaller micro-batch (micro_batch_size=...); with FSDP, more shards shrink the optimizer step"
                 " (and grad_sync='each' drops the unsharded gradient that 'last' accumulates)",
}
# the same fixes when every micro-batch is already one row: a smaller one does not exist
_FIXES_AT_ONE_ROW = {
    "activations": "enable activation checkpointing (checkpointing=True) or train shorter sequences (P, T): "
                   "micro-batches are already 1 row (micro_batch_size=1)",
    "workspace": "with FSDP, more shards shrink the optimizer step (and grad_sync='each' drops the unsharded gradient "
                 "that 'last' accumulates); micro-batches are already 1 row (micro_batch_size=1)",
}
_FIX_OF = {"params": "state", "grads": "state", "optimizer": "state", "master_weights": "state",
           "activations": "activations", "logits": "logits", "kv_cache": "kv_cache", "workspace": "workspace"}


def check_host_fits(node: int, held: Mapping[str, tuple[MemoryBreakdown, int]], capacity_bytes: int) -> None:
    """Raise `PlacementError` if node `node`'s host memory cannot hold what its ranks offload;
    `held` maps each role to (its per-rank host breakdown, how many of the node's ranks hold it).
    The roles' states stay together; their optimizer steps (the transient workspace) run one role
    after another, so only the largest counts."""
    need = (sum(breakdown.persistent().total * ranks for breakdown, ranks in held.values())
            + max((breakdown.transient().total * ranks for breakdown, ranks in held.values()), default=0))
    if need <= capacity_bytes:
        return
    roles = "\n         ".join(f"{role}: {breakdown} on each of {ranks} rank(s)" for role, (breakdown, ranks) in held.items())
    raise PlacementError(
        f"the host memory of node {node} cannot hold what its ranks offload: they need "
        f"{format_bytes(need)} but the node has {capacity_bytes / GiB:.1f} GiB (short by {format_bytes(need - capacity_bytes)}).\n"
        f"  needs: {roles}\n"
        "  fix: spread the state over more nodes (more FSDP shards), keep a role's state on the device where it fits "
        "(cpu_offload=False), or give the host memory per device: rg.Mesh(..., host_memory_gib=...)"
    )


def check_fits(role: str, rank: int, need: MemoryBreakdown, capacity_bytes: int, *, when: str = "",
               one_row_micro_batches: bool = False) -> None:
    """Raise `PlacementError` if `need` exceeds `capacity_bytes`; the message names the role, the
    rank, the moment (`when`, for roles sharing ranks), the breakdown it needs, what the device has
    and the fixes for its largest parts (none that asks for a smaller micro-batch when
    `one_row_micro_batches`: every update on these ranks already trains one row at a time)."""
    if need.total <= capacity_bytes:
        return
    by_fix: dict[str, int] = {}
    for name, value in attrs.asdict(need).items():
        by_fix[_FIX_OF[name]] = by_fix.get(_FIX_OF[name], 0) + value
    table = {**_FIXES, **_FIXES_AT_ONE_ROW} if one_row_micro_batches else _FIXES
    fixes = [table[key] for key, value in sorted(by_fix.items(), key=lambda item: -item[1]) if value]
    raise PlacementError(
        f"role {role} does not fit on rank {rank}: it needs {format_bytes(need.total)} but the device has "
        f"{capacity_bytes / GiB:.1f} GiB (short by {format_bytes(need.total - capacity_bytes)}).\n"
        f"  needs: {need}\n"
        + (f"  when: {when}\n" if when else "")
        + "  fix: " + "\n       ".join(fixes)
    )



# -- whole processes of a run: the controller and each rank --------------------------------------
def process_memory(plan: Any, options: Any = None) -> dict[str, MemoryBreakdown]:
    """What each process of a spmd/Ray run of `plan` holds beyond the interpreter and the libraries it
    imports (a baseline to measure once and add: `benchmarks/scale.py`), by process: "controller",
    "rank 0", "rank 1", ...

    controller: no model (it holds the rewards, the tokenizer, the data and the plans): nothing here.
    rank r on a cpu mesh, whose device is host memory: every phase of every group placed on r
      together, as `colocated_moments(offload=False)` counts them (an offload step moves nothing on
      a cpu device): each phase's persistent parts (the FSDP2 shards, their gradients and AdamW
      state, a reference's shard, the generation engine's full copy) and the largest transient one.
      With the run's `options` (`CompiledRL.options`), a LoRA policy whose engine runs on its own
      base is counted as the executor holds it (`on_lora_base`).
    rank r on an accelerator: what it keeps in host memory (`plan.host_memory`: offloaded state).
    """
    if options is not None and not (isinstance(getattr(options, "lora", None), Mapping) and hasattr(options, "models")):
        raise TypeError(f"process_memory: options must be the run's CompileOptions (compiled.options: its lora and "
                        f"models), or None; got {type(options).__name__} {options!r:.80}")
    out = {"controller": MemoryBreakdown()}
    for rank in range(plan.mesh.size):
        groups = [group for group in plan.groups if rank in group.ranks]
        if plan.mesh.device != "cpu":
            out[f"rank {rank}"] = MemoryBreakdown.sum(_breakdown(plan.host_memory[group.name]) for group in groups
                                                      if group.name in plan.host_memory)
            continue
        phases = {f"{group.name}.{phase}": _breakdown(parts)
                  for group in groups for phase, parts in plan.memory.get(group.name, {}).items()}
        policy = next((group for group in groups if group.name == "policy"), None)
        lora = options.lora.get("policy") if options is not None else None
        if policy is not None and lora is not None and shares_lora_base(
                lora.target_modules, trains=policy.train is not None, engine=getattr(policy.generate, "engine", "none"),
                param_dtype=torch.float32):
            from rlgraph.plan.presets import role_model_shape

            phases = on_lora_base(phases, role_model_shape(options.models, "policy"), lora, policy.train.fsdp,
                                  torch.float32)
        out[f"rank {rank}"] = colocated_peak(phases, offload=False)
    return out


def on_lora_base(phases: Mapping[str, MemoryBreakdown], shape: ModelShape, lora: LoraShape, shards: int,
                 dtype: torch.dtype) -> dict[str, MemoryBreakdown]:
    """The "role.phase" peaks of a LoRA policy that `shares_lora_base`, and of its reference (the
    policy with adapters off), as the ranks hold them: the frozen base whole on every rank (FSDP2
    ignores it) and once: `policy.train` params n*e + a*e/shards (the adapters sharded); the engine
    (`policy.generate`) only the adapted linears' merged weights; and the FSDP2 units gathered in a
    forward or backward are the adapters alone (two layers' worth), not the base's units."""
    e, adapters = dtype_bytes(dtype), shape.lora_params(lora)
    layer_adapters = _ceil_div(adapters, shape.layers)
    adapted = shape.layers * sum(i * o for name, (i, o) in shape.linear_shapes().items() if name in set(lora.target_modules))
    regather = (e * 2 * layer_adapters - _fsdp_gather_bytes(shape, e, grads=False)) if shards > 1 else 0
    out = dict(phases)
    for name, part in phases.items():
        role, phase = _role_phase(name)
        if role not in ("policy", "ref"):
            continue
        if phase == "generate" and role == "policy":
            part = attrs.evolve(part, params=adapted * e)
        elif phase in ("train", "infer"):
            assert part.workspace + regather >= 0, (name, part)  # the base's gathered units are in its workspace
            params = shape.n_params * e + _ceil_div(adapters * e, shards) if (role, phase) == ("policy", "train") else 0
            part = attrs.evolve(part, params=params, workspace=part.workspace + regather)
        out[name] = part
    return out


def _breakdown(parts: Mapping[str, int]) -> MemoryBreakdown:
    """A `Plan.memory` entry ({part: bytes, "total": ...}) as a `MemoryBreakdown`."""
    return MemoryBreakdown(**{name: value for name, value in parts.items() if name != "total"})
