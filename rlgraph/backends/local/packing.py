"""Packed sequences: the forwards of training and log-probs without padding.

The rows of a micro-batch are laid end to end as one sequence of their real tokens (prompt and
response, padding dropped): `[1, L]` with L = the sum of the rows' lengths, in place of `[n, P+T]`.
Position ids restart at 0 in each row, and attention is confined to each row by a block-diagonal
causal mask, so every real token sees exactly the tokens it sees in the padded forward, at the
same positions: the log-probs, the loss and its gradients are those of the padded path up to the
summation order of fp32 (tests/backends/test_packing.py).

Micro-batches are sized by a token budget (`micro_batch_tokens`) instead of a row count:
`pack_rows` fills each micro-batch with rows up to the budget (first fit, longest rows first).

The mask is a dense bool [L, L] for SDPA (or an additive float one for eager attention): on the
CPU that computes the L x L scores of the micro-batch, of which only the diagonal blocks are kept.
Varlen kernels (flash-attention's `cu_seqlens`, `flex_attention` block masks) compute only the
blocks; they are GPU options and untested here.
"""

from __future__ import annotations

import torch

from rlgraph.batches import Rollouts
from rlgraph.errors import ConfigError

PACKED_ATTENTION = ("sdpa", "eager")  # the attention implementations whose 4-D mask is built here


def row_tokens(rollouts: Rollouts) -> torch.Tensor:
    """int64[N]: each row's real tokens, prompt and response (what a packed forward runs)."""
    return rollouts.prompt_mask.sum(1) + rollouts.attention_mask.sum(1)  # [N]


def check_budget(budget: object, where: str) -> int:
    """`budget` as a token count, or a `ConfigError` naming `where` (0, negatives, floats, strings)."""
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ConfigError(f"{where}: micro_batch_tokens={budget!r} is not a whole number of tokens >= 1",
                          fix="give a token budget per micro-batch, e.g. micro_batch_tokens=4096, or None for "
                              "micro-batches of rows")
    return budget


def pack_rows(rows: torch.Tensor, tokens: torch.Tensor, budget: int, where: str) -> list[torch.Tensor]:
    """Split `rows` (indices into the batch) into micro-batches of at most `budget` tokens.

    `tokens[i]` is row i's length (`row_tokens`). First fit over the rows, longest first, so the
    micro-batches are few and full; within a micro-batch the rows keep their order in `rows`.
    A row longer than the budget cannot be packed: a `ConfigError` names it.

    >>> pack_rows(torch.arange(4), torch.tensor([5, 3, 4, 2]), 7, "here")
    [tensor([0, 3]), tensor([1, 2])]
    """
    check_budget(budget, where)
    lengths = tokens[rows].tolist()
    if lengths and max(lengths) > budget:
        longest = max(range(len(lengths)), key=lengths.__getitem__)
        raise ConfigError(f"{where}: row {int(rows[longest])} has {lengths[longest]} tokens (prompt + response), more "
                          f"than micro_batch_tokens={budget}; a row is never split across micro-batches",
                          fix=f"micro_batch_tokens >= {max(lengths)} (at least the prompt width P plus max_new_tokens "
                              "covers every row)")
    bins: list[list[int]] = []  # positions in `rows`
    room: list[int] = []
    for position in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fit = next((b for b, left in enumerate(room) if left >= lengths[position]), None)
        if fit is None:
            bins.append([])
            room.append(budget)
            fit = len(bins) - 1
        bins[fit].append(position)
        room[fit] -= lengths[position]
    return [rows[sorted(chosen)] for chosen in bins]


def packed_attention_mask(lengths: torch.Tensor, implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """The [1, 1, L, L] mask of sequences of `lengths` laid end to end: causal within each, nothing across.

    `implementation` is the model's attention implementation: SDPA takes a bool mask (True:
    attend), eager attention an additive one (0 or the dtype's lowest value)."""
    if implementation not in PACKED_ATTENTION:
        raise ConfigError(f"packed sequences: the model's attention implementation is {implementation!r}; the packed "
                          f"forward builds a block-diagonal mask for {' or '.join(PACKED_ATTENTION)} only (varlen "
                          "flash-attention and flex_attention are untested here)",
                          fix="build the model with attn_implementation='sdpa', or micro_batch_tokens=None (padded rows)")
    segment = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)  # [L]
    places = torch.arange(len(segment), device=lengths.device)  # [L]
    allowed = (segment[:, None] == segment[None, :]) & (places[:, None] >= places[None, :])  # [L, L]
    if implementation == "sdpa":
        return allowed[None, None]  # [1, 1, L, L]
    lowest = torch.finfo(dtype).min
    return torch.zeros(allowed.shape, dtype=dtype, device=lengths.device).masked_fill(~allowed, lowest)[None, None]


def packed_hidden_states(decoder: torch.nn.Module, rollouts: Rollouts, implementation: str,
                         dtype: torch.dtype) -> torch.Tensor:
    """Final-norm hidden states [N, T, H] of `rollouts` from one packed forward of `decoder`.

    Row r, column t is the state that predicts response token t: the state of the last real token
    before it (the padded path's rule, `logprobs.response_hidden_states`), found in the packed order.
    """
    width = rollouts.prompt_ids.shape[1]
    steps = rollouts.response_ids.shape[1]
    ids = torch.cat([rollouts.prompt_ids, rollouts.response_ids], dim=1)  # [N, P+T]
    real = torch.cat([rollouts.prompt_mask, rollouts.attention_mask], dim=1).bool()  # [N, P+T]
    lengths = real.sum(1)  # [N]
    rank_in_row = real.long().cumsum(-1) - 1  # [N, P+T]: a real token's position in its own row
    packed_ids, positions, mask = _packed_inputs(ids, rank_in_row, real, lengths, implementation, dtype)
    hidden = decoder(input_ids=packed_ids, attention_mask=mask, position_ids=positions,
                     use_cache=False).last_hidden_state[0]  # [L, H]
    return hidden[packed_state_index(real, predicting_columns(real, width, steps))]  # [N, T, H]


def predicting_columns(real: torch.Tensor, width: int, steps: int) -> torch.Tensor:
    """i64[N, T]: the column of rows `real` bool[N, P+T] whose state predicts response token t, the
    last real column before it: t-1, unless padding sits between turns of a multi-turn rollout (a
    padding column's state reads a pad id, not the context)."""
    columns = torch.arange(real.shape[1], device=real.device)  # [P+T]
    last_real = torch.where(real, columns, 0).cummax(dim=1).values  # [N, P+T]: last real column <= j
    return last_real[:, width - 1: width - 1 + steps]  # [N, T]


def packed_state_index(real: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """i64[N, T]: where the padded columns `before` [N, T] of rows `real` bool[N, P+T] land in the
    packed sequence of the rows' real tokens laid end to end."""
    lengths = real.sum(1)  # [N]
    starts = lengths.cumsum(0) - lengths  # [N]: where each row begins in the packed sequence
    rank_in_row = real.long().cumsum(-1) - 1  # [N, P+T]: a real token's position in its own row
    packed_index = starts[:, None] + rank_in_row.gather(1, before)  # [N, T]
    # a column with no real token before it (only at unmasked positions) reads row r's first state
    return torch.maximum(packed_index, starts[:, None])  # [N, T]


# Under torch.compile (`train.compile`) the packing stays eager: L (the real tokens) is
# data-dependent; its outputs are marked dynamic so the decoder's graph serves every L.
@torch.compiler.disable
def _packed_inputs(ids: torch.Tensor, rank_in_row: torch.Tensor, real: torch.Tensor, lengths: torch.Tensor,
                   implementation: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token ids [1, L], position ids [1, L], attention mask [1, 1, L, L]) of the rows' real tokens."""
    packed = (ids[real][None], rank_in_row[real][None], packed_attention_mask(lengths, implementation, dtype))
    for tensor in packed:
        for dim in range(1, tensor.dim()):
            torch._dynamo.maybe_mark_dynamic(tensor, dim)
    return packed
