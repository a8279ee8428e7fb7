"""Masked statistics and loss aggregations, with global normalisation across micro-batches.

Statistics (`masked_sum`, `masked_mean`, `masked_max`, `masked_var`, `masked_whiten`) summarise
the values they are given. Loss aggregations (`token_mean`, `seq_mean_token_sum`,
`seq_mean_token_mean`, `seq_mean_token_sum_norm`) reduce a per-token loss f32[N,T] to a scalar and
divide by a *count*: unmasked tokens, non-empty sequences, or sequences x horizon.

Global normalisation. `rg.update` splits a mini-batch into micro-batches (and data-parallel
shards) and sums their gradients. For that sum to equal the full mini-batch loss, every piece
must divide by the count of the *whole* mini-batch, not its own. The runtime therefore wraps each
micro-batch in `loss_normalization(tokens, sequences, horizon)` with the counts of the whole
mini-batch (`global_counts` of each piece, summed, all-reduced over ranks):

    tokens, sequences = global_counts(full_mask)        # or sum the pieces' counts
    for piece in micro_batches:
        with loss_normalization(tokens, sequences, horizon=max_new_tokens):
            loss_of(piece).backward()                   # sum of pieces == full-batch loss

Outside the context the aggregations use the local counts of the mask they receive, each clamped
to at least 1, so a fully masked batch gives a loss of 0, never NaN.
Statistics never read the context: they describe the tensor they are given.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import attrs
import torch
from torch import Tensor

from rlgraph.errors import SpecError, user_location
from rlgraph.ir.ops import traceable

Count = int | float | Tensor


@attrs.frozen
class LossNormalization:
    """The counts of the whole mini-batch that loss aggregations divide by."""

    tokens: Count  # unmasked tokens
    sequences: Count  # rows with at least one unmasked token
    horizon: Count | None = None  # the constant length of `seq_mean_token_sum_norm` (Dr.GRPO)


_ACTIVE: contextvars.ContextVar[LossNormalization | None] = contextvars.ContextVar(
    "rlgraph_loss_normalization", default=None
)


def _at_least_one(count: Count) -> Count:
    if isinstance(count, Tensor):
        return count.clamp(min=1)
    if count < 0:
        raise ValueError(f"loss_normalization: counts must be >= 0, got {count}")
    return max(count, 1)


@contextlib.contextmanager
def loss_normalization(tokens: Count, sequences: Count, horizon: Count | None = None) -> Iterator[LossNormalization]:
    """Inside this block, loss aggregations divide by these global counts (clamped to >= 1).

    `tokens` and `sequences` are the counts of the whole mini-batch (see `global_counts`);
    `horizon` is the constant length `seq_mean_token_sum_norm` divides by (default: the T of the
    loss it aggregates). Nested blocks shadow outer ones; the previous value is restored on exit.
    """
    if horizon is not None and not isinstance(horizon, Tensor) and horizon <= 0:
        raise ValueError(f"loss_normalization: horizon must be > 0, got {horizon}")
    norm = LossNormalization(_at_least_one(tokens), _at_least_one(sequences), horizon)
    reset = _ACTIVE.set(norm)
    try:
        yield norm
    finally:
        _ACTIVE.reset(reset)


def active_loss_normalization() -> LossNormalization | None:
    """The global counts in force, or None outside `loss_normalization` (for fused kernels)."""
    return _ACTIVE.get()


def as_mask(mask: Tensor, owner: str, name: str = "mask") -> Tensor:
    """`mask` as bool[...]. Integer masks (HF attention masks) read as `!= 0`; a float mask is refused:
    it is either 0/1 (say so with `.bool()`) or weights, which `.to(bool)` would silently turn into 1s.

    Raised as a SpecError at the user's line, eagerly and at trace time (where the op runs on witnesses).
    """
    if not isinstance(mask, Tensor):
        raise SpecError(f"F.{owner}: {name} must be a bool tensor, got {type(mask).__name__}", user_location(),
                        fix=f"pass the rollouts' mask: F.{owner}(..., ro.mask)")
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point() or mask.is_complex():
        raise SpecError(f"F.{owner}: {name} is a {mask.dtype} tensor, but a mask must be bool (True = a real token)",
                        user_location(), fix=f"pass a bool mask ({name}.bool() or {name} > 0); to weigh tokens, "
                        f"multiply the per-token values by the weights and keep the bool mask: F.{owner}(x * w, mask)")
    return mask != 0


@traceable
def global_counts(mask: Tensor) -> tuple[Tensor, Tensor]:
    """(tokens, sequences) of `mask`: i64[] unmasked tokens and i64[] non-empty rows.

    Counts are additive: the counts of a mini-batch are the sums of its micro-batches' counts
    (all-reduce them with SUM across data-parallel ranks).
    """
    mask = as_mask(mask, "global_counts")
    tokens = mask.sum()  # []
    sequences = mask.any(dim=-1).sum()  # []
    return tokens, sequences


def _token_count(mask: Tensor) -> Count:
    norm = _ACTIVE.get()
    return norm.tokens if norm is not None else mask.sum().clamp(min=1)


def _sequence_count(mask: Tensor) -> Count:
    norm = _ACTIVE.get()
    return norm.sequences if norm is not None else mask.any(dim=-1).sum().clamp(min=1)


# -- statistics ---------------------------------------------------------------------------------


@traceable
def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """sum(values[mask]); values at masked positions are ignored, even inf or NaN."""
    kept = torch.where(as_mask(mask, "masked_sum"), values, 0.0)  # like values
    return kept.sum() if dim is None else kept.sum(dim=dim)


@traceable
def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """sum(values[mask]) / max(count(mask), 1): 0 where nothing is unmasked (verl: / (count + 1e-8))."""
    mask = as_mask(mask, "masked_mean")
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


@traceable
def masked_max(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """max(values[mask]): 0 where nothing is unmasked (as `masked_mean`); masked values never win, even NaN."""
    mask = as_mask(mask, "masked_max")
    kept = torch.where(mask, values, -torch.inf)  # like values
    if dim is None:
        kept, mask, dim = kept.reshape(-1), mask.reshape(-1), 0
    if kept.shape[dim] == 0:  # amax refuses an empty dim; nothing is unmasked there
        return kept.sum(dim=dim)
    return torch.where(mask.any(dim=dim), kept.amax(dim=dim), 0.0)


@traceable
def masked_var(values: Tensor, mask: Tensor, *, unbiased: bool = True) -> Tensor:
    """Variance of values[mask]: sum((x - mean)^2) / (n - 1) (Bessel, as verl) or / n.

    Edge cases (verl raises or divides by zero): n <= 1 gives 0.
    """
    mask = as_mask(mask, "masked_var")
    count = mask.sum()  # []
    squares = masked_sum(_centered(values, mask).square(), mask)  # []
    return squares / ((count - 1) if unbiased else count).clamp(min=1)


def _centered(values: Tensor, mask: Tensor) -> Tensor:
    """values - mean(values[mask]), 0 at masked positions, exactly 0 where all unmasked values are equal.

    The mean is taken after subtracting the largest unmasked value (a shift that changes nothing in
    exact arithmetic), so equal values give exactly 0 instead of rounding noise that a whitening
    would then multiply by 1/sqrt(eps) (1e4 at eps = 1e-8).
    """
    values = torch.where(mask, values, 0.0)  # like values; keeps garbage out of the gradient
    largest = torch.where(mask, values, -torch.inf).amax() if values.numel() else values.new_zeros(())  # []
    shift = torch.where(torch.isfinite(largest), largest, 0.0).detach()  # [] (0 when nothing is unmasked)
    shifted = torch.where(mask, values - shift, 0.0)  # like values
    return torch.where(mask, shifted - masked_mean(shifted, mask), 0.0)


@traceable
def masked_whiten(values: Tensor, mask: Tensor, *, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(x - mean) / sqrt(var + eps) over values[mask] (verl `masked_whiten`, unbiased var).

    `shift_mean=False` adds the mean back. Unlike verl, masked positions are set to 0.
    All-equal values (var 0) give 0.
    """
    mask = as_mask(mask, "masked_whiten")
    values = torch.where(mask, values, 0.0)  # like values; keeps garbage out of the gradient
    whitened = _centered(values, mask) * torch.rsqrt(masked_var(values, mask) + eps)  # like values
    if not shift_mean:
        whitened = whitened + masked_mean(values, mask)
    return torch.where(mask, whitened, 0.0)


# -- loss aggregations --------------------------------------------------------------------------


@traceable
def token_mean(loss: Tensor, mask: Tensor) -> Tensor:
    """sum(loss[mask]) / tokens: every unmasked token weighs the same (verl "token-mean", DAPO)."""
    mask = as_mask(mask, "token_mean")
    return masked_sum(loss, mask) / _token_count(mask)


@traceable
def seq_mean_token_sum(loss: Tensor, mask: Tensor) -> Tensor:
    """sum over rows of sum(loss[row]) / sequences (verl "seq-mean-token-sum").

    `sequences` counts rows with at least one unmasked token; verl counts every row.
    """
    mask = as_mask(mask, "seq_mean_token_sum")
    return masked_sum(loss, mask) / _sequence_count(mask)


@traceable
def seq_mean_token_mean(loss: Tensor, mask: Tensor) -> Tensor:
    """mean over non-empty rows of the row's token mean (verl "seq-mean-token-mean", GRPO paper).

    Fully masked rows contribute 0 and are not counted (old verl: NaN).
    """
    mask = as_mask(mask, "seq_mean_token_mean")
    per_row = masked_mean(loss, mask, dim=-1)  # [N]
    return per_row.sum() / _sequence_count(mask)


@traceable
def seq_mean_token_sum_norm(loss: Tensor, mask: Tensor, *, horizon: int | None = None) -> Tensor:
    """sum(loss[mask]) / (sequences * horizon): Dr.GRPO's length-unbiased aggregation.

    `horizon` is a constant length (the generation budget): the argument if given, else the
    `loss_normalization` horizon, else T. Like TRL's "dr_grpo" it also divides by the sequence
    count; verl's "seq-mean-token-sum-norm" divides by the horizon only (so it grows with N).
    """
    mask = as_mask(mask, "seq_mean_token_sum_norm")
    norm = _ACTIVE.get()
    if horizon is None:
        horizon = norm.horizon if norm is not None and norm.horizon is not None else loss.shape[-1]
    return masked_sum(loss, mask) / (_sequence_count(mask) * horizon)
