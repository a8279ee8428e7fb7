"""Counter-based sampling: the sampling settings and the noise that picks each token.

The noise that picks token s of sample j of a prompt is a pure hash of (seed, call, the prompt's
`Prompts.index`, j, s, vocab id), not a draw from a stateful generator shared by the batch. So a
prompt gets the same noise whichever rank or engine generates it and whatever else is in its batch:
N data-parallel shards sample what one process would (up to the model's own rounding). The native
engine (`generation.py`), its compiled decode (`lean_decode.py`), the multi-turn rollouts
(`multiturn.py`) and the executors' sampling streams all draw from here.
"""

from __future__ import annotations

import attrs
import torch

from rlgraph.kernels.sampling import argmax_and_logprob, gumbel_noise, splitmix64


def _non_negative(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not value >= 0.0:
        raise ValueError(f"SamplingParams.{attribute.name} must be >= 0 (0 means greedy), got {value}")


def _probability(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not 0.0 < value <= 1.0:
        raise ValueError(f"SamplingParams.{attribute.name} must be in (0, 1], got {value}; "
                         "use 1.0 to disable nucleus sampling")


def _positive(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if not value >= 1:
        raise ValueError(f"SamplingParams.{attribute.name} must be >= 1, got {value}")


def _stop_strings(instance: object, attribute: attrs.Attribute, value: tuple) -> None:
    if not all(isinstance(item, str) and item for item in value):
        raise ValueError(f"SamplingParams.stop must hold non-empty strings, got {value!r}")


@attrs.frozen
class SamplingParams:
    """How to sample: `temperature` 0 is greedy; `top_p` < 1 keeps the smallest nucleus of
    tokens whose probability adds up to at least `top_p`; at most `max_new_tokens` per response;
    a response ends after the token that completes the first of the `stop` strings (`cut_at_stop`)."""

    temperature: float = attrs.field(default=1.0, converter=float, validator=_non_negative)
    top_p: float = attrs.field(default=1.0, converter=float, validator=_probability)
    max_new_tokens: int = attrs.field(default=16, validator=[attrs.validators.instance_of(int), _positive])
    stop: tuple[str, ...] = attrs.field(default=(), converter=tuple, validator=_stop_strings)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def nucleus_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """`logits` [N, V] with every token outside the top-`top_p` nucleus set to -inf.

    A token is kept when the probability of the tokens ranked above it is below `top_p`, so the
    most likely token is always kept.
    """
    if top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [N, V]
    probs = sorted_logits.softmax(dim=-1)  # [N, V]
    mass_above = probs.cumsum(dim=-1) - probs  # [N, V]
    drop_sorted = mass_above >= top_p  # [N, V]
    drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)  # [N, V]
    return logits.masked_fill(drop, float("-inf"))


# -- counter-based noise ---------------------------------------------------------------------------
# The hash (splitmix64), its uniforms and the Gumbel noise are the fused sampling kernel's torch
# reference (`rlgraph.kernels.sampling`).


def as_int64(value: int) -> int:
    """`value` mod 2**64, as the int64 with the same bits (so any Python int can seed a stream)."""
    value &= 2**64 - 1
    return value - 2**64 if value >= 2**63 else value


def sampling_keys(seed: int, call: int, index: torch.Tensor, n: int) -> torch.Tensor:
    """i64[B*n] row keys: row i*n + j (sample j of prompt `index[i]`) gets
    splitmix64(splitmix64(splitmix64(seed, call), index[i]), j)."""
    stream = splitmix64(torch.tensor(as_int64(seed), device=index.device), call)  # []
    prompt = splitmix64(stream, index)  # [B]
    return splitmix64(prompt[:, None], torch.arange(n, device=index.device)).reshape(-1)  # [B*n]


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, keys: torch.Tensor | None, *, noise: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens i64[N], logprobs f32[N]) drawn from `logits` [N, V] with the noise of `keys` i64[N].

    Gumbel-max: token = argmax_v(filtered[v] + g[v]), g iid standard Gumbel from `gumbel_noise`,
    is an exact draw from softmax(filtered), with filtered = nucleus_filter(logits / temperature).
    Greedy (temperature 0) is argmax and needs no keys. The log-prob is taken from the
    temperature-scaled distribution over the full vocabulary (before nucleus filtering;
    temperature 1 when greedy), which is what a training-side recompute with the same
    temperature gives. `noise` [N, V], when given, is `gumbel_noise(keys, V)` computed ahead.
    """
    logits = logits.float()  # [N, V]; the noise and its sums in float32 whatever the model's dtype
    if params.greedy:
        return argmax_and_logprob(logits, logits)
    assert keys is not None or noise is not None, "sampling needs one key per row"
    noise = gumbel_noise(keys, logits.shape[-1]) if noise is None else noise  # [N, V]
    scaled = logits / params.temperature  # [N, V]
    filtered = nucleus_filter(scaled, params.top_p)  # [N, V], -inf outside the nucleus
    return argmax_and_logprob(scaled, filtered + noise)


class StepNoise:
    """The Gumbel noise of decode step s, `gumbel_noise(splitmix64(keys, s), V)` [N, V], computed
    for a block of steps at once while N*V is small: the same words (the hash is elementwise) in
    a few large ops instead of a dozen small ones per token, which is most of the sampling time
    on a small vocabulary. Blocks hold at most `budget` words (8 bytes each, while hashing)."""

    def __init__(self, keys: torch.Tensor, vocab: int, steps: int, budget: int = 2**20) -> None:
        self.keys, self.vocab, self.steps = keys, vocab, steps
        self.block = max(1, min(steps, budget // max(len(keys) * vocab, 1)))
        self.start, self.noise = 0, None

    def at(self, step: int) -> torch.Tensor:
        if self.noise is None or not self.start <= step < self.start + self.noise.shape[1]:
            self.start = step
            self.noise = steps_noise(self.keys, self.vocab, step, min(step + self.block, self.steps))  # [N, b, V]
        return self.noise[:, step - self.start]  # [N, V]


def steps_noise(keys: torch.Tensor, vocab: int, start: int, stop: int) -> torch.Tensor:
    """f32[N, stop - start, V]: the Gumbel noise of decode steps start..stop-1 (`StepNoise`), hashed at once."""
    counters = torch.arange(start, stop, device=keys.device)  # [b]
    step_keys = splitmix64(keys[:, None], counters)  # [N, b]
    return gumbel_noise(step_keys.reshape(-1), vocab).view(len(keys), len(counters), vocab)  # [N, b, V]


@attrs.define
class SamplingStream:
    """An executor's sampling stream: its `seed` and how many generate `calls` it has made.

    Generate call k samples with the key (seed, k), so every rank that makes the same calls
    draws from the same stream; checkpoints save `calls` so a resumed run continues it.
    """

    seed: int
    calls: int = 0

    def advance(self, temperature: float = 1.0) -> int:
        """The call number for this generate call; the next call gets the one after. Greedy calls
        (temperature 0) draw nothing and leave the stream where it is, so evaluations never shift
        the samples of the training steps after them (a run with `eval.every: 10` samples what
        one with `eval.every: 50` samples, and a controller that evaluates samples like workers that do not)."""
        if temperature == 0:
            return self.calls
        self.calls += 1
        return self.calls - 1
