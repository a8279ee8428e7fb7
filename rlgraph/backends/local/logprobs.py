"""Training-side log-probs of rollout responses under a causal LM (the `logprobs` primitive).

One forward of the decoder body over prompt ++ response, then the LM head + log-softmax + gather
in the chunked `rlgraph.kernels.logprob_head.token_logprobs`, so the [N*T, V] logits never exist
at once. For a model in eval mode the result matches the generator's sampling log-probs on its
own rollouts, which is what makes the first PPO ratio exactly 1.

`role_outputs` is a role's per-token outputs in a training forward: an LM's log-probs (and entropy)
here, a critic's values from its head (`critic.py`); the executor's update runs it (compiled or not).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from rlgraph.backends.local.packing import packed_hidden_states, predicting_columns
from rlgraph.backends.local.vlm_forward import is_vision_lm, vision_response_states
from rlgraph.batches import Rollouts
from rlgraph.kernels.logprob_head import BLOCK_FLOOR_ELEMENTS, token_logprobs


def _decoder(model: PreTrainedModel) -> torch.nn.Module:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    if decoder is None:
        raise ValueError(f"sequence_logprobs: cannot find the decoder body of {type(model).__name__}; "
                         "it needs `get_decoder()` or a `.model` attribute returning final-norm hidden states")
    return decoder


def _head_weight(model: PreTrainedModel) -> torch.Tensor:
    head = model.get_output_embeddings()
    if head is None or getattr(head, "bias", None) is not None:
        raise ValueError(f"sequence_logprobs: {type(model).__name__} needs a bias-free linear LM head "
                         "(`get_output_embeddings()` with only a weight [V, H])")
    for field in ("final_logit_softcapping", "logit_scale"):
        if getattr(model.config, field, None) not in (None, 1.0):
            raise ValueError(f"sequence_logprobs: the config sets {field}={getattr(model.config, field)}, "
                             "which the fused LM head does not apply; use a model without it")
    return _adapted_weight(head)  # [V, H]


def _adapted_weight(head: torch.nn.Module) -> torch.Tensor:
    """The weight [V, H] the head multiplies by: a peft LoRA head's base weight plus its active
    adapters' deltas (B A scaled, differentiable, so the adapters train through the fused head),
    as its own forward computes them; a plain head's weight."""
    base = getattr(head, "base_layer", None)
    if base is None:
        return head.weight
    weight = base.weight
    if getattr(head, "disable_adapters", False) or getattr(head, "merged", False):
        return weight  # adapters off (the reference), or already merged into the base weight
    for adapter in head.active_adapters:
        if adapter in head.lora_A:
            weight = weight + head.get_delta_weight(adapter)  # [V, H]
    return weight


def response_hidden_states(model: PreTrainedModel, rollouts: Rollouts, *, packed: bool = False) -> torch.Tensor:
    """Final-norm hidden states [N, T, H]; row r, column t is the state that predicts response token t.

    `packed`: one forward over the rows' real tokens laid end to end (`packing.packed_hidden_states`)
    instead of the padded [N, P+T] batch; the same states up to fp32 summation order."""
    if getattr(rollouts, "image_grid_thw", None) is not None or is_vision_lm(model):  # images, or a VLM's token check
        return vision_response_states(model, rollouts, packed=packed)
    if packed:
        return packed_hidden_states(_decoder(model), rollouts, model.config._attn_implementation, model.dtype)
    width = rollouts.prompt_ids.shape[1]
    steps = rollouts.response_ids.shape[1]
    ids = torch.cat([rollouts.prompt_ids, rollouts.response_ids], dim=1)  # [N, P+T]
    # attend to every real token, the environment's observations too (a multi-turn rollout's
    # `context_mask`): they are context for the policy's later tokens, though never trained on
    mask = torch.cat([rollouts.prompt_mask, rollouts.attention_mask], dim=1).long()  # [N, P+T]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [N, P+T]
    hidden = _decoder(model)(input_ids=ids, attention_mask=mask, position_ids=positions,
                             use_cache=False).last_hidden_state  # [N, P+T, H]
    before = predicting_columns(mask.bool(), width, steps)  # [N, T]: last real column < the response's column t
    return hidden.gather(1, before[:, :, None].expand(-1, -1, hidden.shape[-1]))  # [N, T, H]


def sequence_logprobs(
    model: PreTrainedModel, rollouts: Rollouts, *, temperature: float = 1.0, with_entropy: bool = False,
    packed: bool = False, dense_head: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log p(response_ids[r, t] | prompt, response[:t]) under softmax(logits / temperature).

    Returns f32[N, T] (and, with `with_entropy`, the entropy f32[N, T] of the same distribution),
    zero where `rollouts.mask` is False, differentiable with respect to the model's parameters.
    The model's current mode (train/eval) is used as is. `packed`: the forward runs on the rows
    packed without padding (`response_hidden_states`). `dense_head`: the LM head over all N x T
    positions at once (`all_positions_head`: the compiled forward's choice where `head_fits_one_block`).
    """
    if not temperature > 0.0:
        raise ValueError(f"sequence_logprobs: temperature must be > 0, got {temperature}; "
                         "for greedy rollouts recompute at temperature 1")
    hidden = response_hidden_states(model, rollouts, packed=packed)  # [N, T, H]
    head = all_positions_head if dense_head else masked_head
    full, entropy = head(hidden, _head_weight(model), rollouts.response_ids, rollouts.mask.bool(),
                         temperature=temperature, with_entropy=with_entropy)  # [N, T], [N, T] | None
    return (full, entropy) if with_entropy else full


def vocabulary_logprobs(model: PreTrainedModel, rollouts: Rollouts, *, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature) over the whole vocabulary at every response position,
    f32[N, T, V], 0 at padding; differentiable. Holds the [N*T, V] logits at once (what a
    full-distribution divergence needs): 4*N*T*V bytes, unlike the chunked head of `sequence_logprobs`."""
    if not temperature > 0.0:
        raise ValueError(f"vocabulary_logprobs: temperature must be > 0, got {temperature}")
    hidden = response_hidden_states(model, rollouts)  # [N, T, H]
    logits = (hidden.float() / temperature) @ _head_weight(model).float().t()  # [N, T, V]
    return torch.where(rollouts.mask.bool()[..., None], torch.log_softmax(logits, dim=-1), 0.0)  # [N, T, V]


def head_fits_one_block(model: PreTrainedModel, rows: int, steps: int) -> bool:
    """Whether the f32 logits of all `rows` x `steps` positions fit the chunked head's one-block
    floor (`BLOCK_FLOOR_ELEMENTS`, 16 MiB), so `all_positions_head` holds no larger [., V] block
    than the chunked head would (a tiny vocabulary; a 150k-token one only up to 27 positions)."""
    return rows * steps * _head_weight(model).shape[0] <= BLOCK_FLOOR_ELEMENTS


def all_positions_head(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, *,
                       temperature: float, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`masked_head`'s result from every position of `hidden` [N, T, H] at once, in plain
    differentiable ops that `torch.compile` traces into the forward's graph: no data-dependent
    token count, no graph break, one compiled backward. The forward is the chunked head's
    arithmetic op for op (`logprob_head._chunk_logp`); padding positions are computed and dropped."""
    rows, steps, width = hidden.shape
    h_scaled = hidden.reshape(rows * steps, width).float() / temperature  # [N*T, H]
    logits = h_scaled @ weight.float().t()  # [N*T, V]
    shifted = logits - logits.amax(dim=-1, keepdim=True)  # [N*T, V]
    logp = shifted - torch.exp(shifted).sum(-1, keepdim=True).log()  # [N*T, V]
    lp = logp.gather(1, targets.reshape(rows * steps, 1)).reshape(rows, steps)  # [N, T]
    full = torch.where(mask, lp, 0.0)  # [N, T]
    if not with_entropy:
        return full, None
    entropy = -(torch.exp(logp) * logp).sum(-1).reshape(rows, steps)  # [N, T]
    return full, torch.where(mask, entropy, 0.0)  # [N, T], [N, T]


# Under torch.compile (`train.compile`) this head stays eager (where `all_positions_head` does not
# serve): its M (the real tokens of a micro-batch) is data-dependent, and the chunk loop would make
# Dynamo compile a graph per M.
@torch.compiler.disable
def masked_head(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, *,
                temperature: float, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunked LM head on the states `hidden` [N, T, H] of the real tokens `mask` [N, T]:
    log-probs of `targets` [N, T] (and entropy), zero where `mask` is False."""
    logprobs, entropy = token_logprobs(hidden[mask], weight, targets[mask],
                                       temperature=temperature, with_entropy=with_entropy)  # [M], [M] | None
    zeros = torch.zeros(mask.shape, dtype=torch.float32, device=hidden.device)  # [N, T]
    full = zeros.masked_scatter(mask, logprobs.float())  # [N, T]
    return full, (zeros.masked_scatter(mask, entropy.float()) if with_entropy else None)  # [N, T], [N, T] | None


def role_outputs(module: torch.nn.Module, kind: str, rollouts: Rollouts, *, temperature: float, with_entropy: bool,
                 packed: bool = False, dense_head: bool = False,
                 vocab: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A role's per-token outputs: the critic's values, or an LM's log-probs (and entropy);
    `packed`: from one forward over the rows' real tokens, without padding; `dense_head`: an LM's
    head over every position at once (`all_positions_head`); `vocab`: an LM's log-softmax over the
    vocabulary [N, T, V] (`vocabulary_logprobs`)."""
    if kind == "critic":
        return module.values(rollouts, packed=packed), None
    if vocab:
        return vocabulary_logprobs(module, rollouts, temperature=temperature), None
    output = sequence_logprobs(module, rollouts, temperature=temperature, with_entropy=with_entropy, packed=packed,
                               dense_head=dense_head)
    return output if with_entropy else (output, None)
