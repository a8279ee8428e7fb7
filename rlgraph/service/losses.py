"""Tinker's built-in losses, with Tinker's meaning of every input and config key, and rlgraph's
registered policy losses by name.

Every loss is a sum over the tokens of every datum (Tinker's convention: no mean, so the caller
scales with `weights` or `advantages`), and gives the per-token loss back as `elementwise_loss`.
With `lp` the per-token log-probs of `target_tokens` under the trained model, `q` the sampler's
(`loss_fn_inputs["logprobs"]`), `A` the advantages and `r = exp(lp - q)`:

    cross_entropy        -sum(weights * lp)                        inputs: target_tokens, weights (default 1)
    importance_sampling  -sum(r * A)                               inputs: target_tokens, logprobs, advantages
    ppo                  -sum(min(r A, clip(r, lo, hi) A))         + config clip_low_threshold (0.8), clip_high_threshold (1.2)
    cispo                -sum(sg(clip(r, lo, hi)) * A * lp)        + the same thresholds
    dro                  -sum(A lp - beta / 2 (lp - q)^2)          + config beta (required, > 0)

ppo and cispo run `rlgraph.functional`'s `ppo_clip` / `cispo` with a summing aggregation (their
clip widths are `1 - lo` and `hi - 1`). Any other name is looked up in rlgraph's loss registry
(`F.get_loss`, which also holds the user's `register_loss` entries): called
`(lp, q, A, mask, **loss_fn_config)` with its result summed the same way (in-process clients;
the Tinker SDK only sends its own names).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import attrs
import torch
from torch import Tensor

from rlgraph import functional as F
from rlgraph.functional.aggregate import masked_sum
from rlgraph.ir.ops import traceable
from rlgraph.service.errors import CallError

BUILTIN = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro")
NEEDS = {"cross_entropy": ("target_tokens",), "importance_sampling": ("target_tokens", "logprobs", "advantages"),
         "ppo": ("target_tokens", "logprobs", "advantages"), "cispo": ("target_tokens", "logprobs", "advantages"),
         "dro": ("target_tokens", "logprobs", "advantages")}
KNOWN_INPUTS = ("target_tokens", "weights", "logprobs", "advantages")
CONFIG_KEYS = {"cross_entropy": {}, "importance_sampling": {},
               "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
               "cispo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
               "dro": {"beta": None}}


@attrs.frozen
class LossBatch:
    """The loss inputs of a batch of datums, right-padded to T tokens: every tensor is [N, T];
    `mask` marks each datum's real tokens."""

    target_tokens: Tensor
    mask: Tensor
    weights: Tensor
    logprobs: Tensor
    advantages: Tensor


# lp [N, T] (differentiable) -> (loss [], per-token loss [N, T])
LossFn = Callable[[Tensor], tuple[Tensor, Tensor]]


def check_loss(name: str, config: Mapping[str, float] | None, *, registered: bool = True) -> dict[str, float]:
    """`config` completed with the loss's defaults; an unknown loss, key or value is a `CallError`
    naming it."""
    config = dict(config or {})
    if name not in CONFIG_KEYS:
        if registered and name in F.LOSSES:
            entry = F.LOSSES[name]
            for key in config:
                if not entry.supported(**{key: 0}):
                    raise CallError(f"the registered loss {name!r} takes no keyword {key!r}", field=f"loss_fn_config.{key}")
            return {key: _number(key, value) for key, value in config.items()}
        known = ", ".join(BUILTIN) + (f"; rlgraph's registered losses: {', '.join(F.LOSSES)}" if registered else "")
        raise CallError(f"unknown loss {name!r} (known: {known})", field="loss_fn",
                        fix="loss_fn='cross_entropy' for supervised data, 'importance_sampling' or 'ppo' for RL")
    allowed = CONFIG_KEYS[name]
    for key in config:
        if key not in allowed:
            keys = ", ".join(allowed) or "none"
            raise CallError(f"{name} takes no config key {key!r} (its keys: {keys})", field=f"loss_fn_config.{key}",
                            fix="remove the key" if not allowed else f"use one of: {keys}")
    full = {key: _number(key, config[key]) if key in config else default for key, default in allowed.items()}
    if name == "dro" and full["beta"] is None:
        raise CallError("dro needs beta, the weight of its quadratic penalty", field="loss_fn_config.beta",
                        fix="loss_fn_config={'beta': 0.05}")
    if name == "dro" and not full["beta"] > 0:
        raise CallError(f"beta must be > 0, got {full['beta']}", field="loss_fn_config.beta")
    if name in ("ppo", "cispo") and not 0 <= full["clip_low_threshold"] <= 1 <= full["clip_high_threshold"]:
        raise CallError(f"the thresholds bound the ratio pi/pi_old around 1: need 0 <= clip_low_threshold <= 1 <= "
                        f"clip_high_threshold, got {full['clip_low_threshold']} and {full['clip_high_threshold']}",
                        field="loss_fn_config.clip_low_threshold", fix="clip_low_threshold=0.8, clip_high_threshold=1.2")
    return full


def _number(key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise CallError(f"must be a finite number, got {value!r}", field=f"loss_fn_config.{key}")
    return float(value)


def make_loss(name: str, config: Mapping[str, float], batch: LossBatch) -> LossFn:
    """The loss `name` over `batch` (its config checked by `check_loss`)."""
    mask, adv, old = batch.mask, batch.advantages, batch.logprobs  # [N, T] each

    def summed(store: list[Tensor]) -> Callable[[Tensor, Tensor], Tensor]:
        def aggregate(per_token: Tensor, mask: Tensor) -> Tensor:  # F's losses hand us their per-token loss
            store.append(per_token)
            return masked_sum(per_token, mask)
        return aggregate

    def loss(lp: Tensor) -> tuple[Tensor, Tensor]:
        store: list[Tensor] = []
        if name == "cross_entropy":
            per_token = -batch.weights * lp  # [N, T]
        elif name == "importance_sampling":
            per_token = -torch.exp((lp - old).clamp(-20.0, 20.0)) * adv  # [N, T]; the clamp keeps exp finite
        elif name == "dro":
            per_token = -(adv * lp - 0.5 * config["beta"] * (lp - old) ** 2)  # [N, T]
        elif name in ("ppo", "cispo"):
            low, high = 1.0 - config["clip_low_threshold"], config["clip_high_threshold"] - 1.0
            op = F.ppo_clip if name == "ppo" else F.cispo
            op(lp, old, adv, mask, clip_low=low, clip_high=high, agg=summed(store))
            per_token = store[0]
        else:  # a registered loss: summed like the built-ins when it takes `agg`, else its own aggregate
            entry = F.get_loss(name)
            value = entry(lp, old, adv, mask, **config, **entry.supported(agg=summed(store)))[0]
            if not store:
                return value, torch.zeros_like(lp)
            per_token = store[0]
        per_token = torch.where(mask, per_token, 0.0)  # [N, T]
        return per_token.sum(), per_token
    return loss


@traceable(name="tinker_loss")
def tinker_loss(lp: Tensor, mask: Tensor, weights: Tensor, old: Tensor, adv: Tensor, *, loss_fn: str,
                config: Mapping[str, float]) -> tuple[Tensor, Tensor]:
    """`make_loss` as one op of a traced program: (loss [], per-token loss [N, T]) from the
    log-probs `lp` [N, T] and the batch's `mask`, `weights`, sampler log-probs `old` and advantages
    `adv` (each [N, T]). One node, so a plan prints `tinker_loss[loss_fn='ppo' ...]` and the
    fusion pass, whose kernels aggregate by mean, leaves Tinker's sums alone."""
    # The loss reads no target tokens: `lp` are already the log-probs of the targets.
    batch = LossBatch(mask.new_zeros((0,), dtype=torch.long), mask, weights, old, adv)
    return make_loss(loss_fn, config, batch)(lp)
