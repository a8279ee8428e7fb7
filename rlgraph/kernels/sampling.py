"""Fused counter-based sampling: hash -> Gumbel noise -> temperature -> argmax -> the token's log-prob,
in one pass over the logits.

    tokens, logprobs = gumbel_sample_triton(logits, keys, temperature)      # i64[N], f32[N]
    tokens, logprobs = gumbel_sample_reference(logits, keys, temperature)   # the same, in torch

Row r draws token argmax_v(logits[r, v] / temperature + g[r, v]) with g[r, v] = -log(-log u),
u = (top 23 bits of splitmix64(keys[r], v) + 1/2) / 2**23: an exact sample of
softmax(logits[r] / temperature) whose noise depends only on (key, v), so any number of ranks,
any batch order and any implementation draw the same token. The log-prob is
logits[r, t] / temperature - logsumexp_v(logits[r, v] / temperature).

The torch reference materialises [N, V] int64 hash words and float noise (several full passes
over [N, V] per decode step: at V = 152k and N = 512, ~0.6 GB per temporary); the Triton kernel
streams the logits once per row in blocks of `BLOCK` tokens and keeps a running (max, argmax) of
the perturbed logits and a running log-sum-exp, so it reads N*V logits and writes 2N numbers.

Ties: torch.argmax and the kernel both keep the first maximal index. The kernel's `log` is
Triton's (libdevice on GPU, numpy under TRITON_INTERPRET) and torch's is its own vectorised log:
they may differ in the last bit, so a token can differ only where two perturbed logits lie within
an ulp or two of each other (probability ~1e-6 per row at these magnitudes); tests pin equality on
fixed seeds and bound the log-prob difference by the summation's rounding.

Nucleus (top-p < 1) filtering needs a sort of each row; it stays in torch
(`rlgraph.backends.local.counter_sampling.sample_tokens`).
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

# splitmix64's constants as signed int64 (torch has no uint64 arithmetic; the bits are the same).
GAMMA = 0x9E3779B97F4A7C15 - 2**64
MIX1 = 0xBF58476D1CE4E5B9 - 2**64
MIX2 = 0x94D049BB133111EB - 2**64


def _shift_right(z: Tensor, bits: int) -> Tensor:
    """Logical (unsigned) right shift of int64 `z` (torch's `>>` on int64 copies the sign bit)."""
    return (z >> bits).bitwise_and_((1 << (64 - bits)) - 1)


def splitmix64(key: Tensor, counter: Tensor | int) -> Tensor:
    """The `counter`-th output of the splitmix64 stream seeded with `key`, elementwise (broadcast):

        z = key + (counter + 1) * 0x9E3779B97F4A7C15
        z = (z ^ z >>> 30) * 0xBF58476D1CE4E5B9;  z = (z ^ z >>> 27) * 0x94D049BB133111EB;  z ^ z >>> 31

    all mod 2**64 (`>>>` unsigned). For a fixed key distinct counters give distinct words, and
    the finaliser spreads each input bit over all output bits, so chaining it
    (`splitmix64(splitmix64(seed, a), b)`) hashes a tuple of counters to 64 well-mixed bits.
    """
    z = key + (torch.as_tensor(counter, dtype=torch.long, device=key.device) + 1) * GAMMA
    # in place from here: on [N, V] a large vocabulary makes every int64 temporary count
    z.bitwise_xor_(_shift_right(z, 30)).mul_(MIX1)
    z.bitwise_xor_(_shift_right(z, 27)).mul_(MIX2)
    return z.bitwise_xor_(_shift_right(z, 31))


def uniform_from_bits(bits: Tensor) -> Tensor:
    """f32 uniforms in (0, 1) from int64 hash words: u = (top 23 bits + 1/2) / 2**23.

    Exact in float32 (23 significant bits plus the half), never 0 or 1, so -log(-log u) is
    finite: it spans [-2.8, 16.6], cutting Gumbel tails of probability < 1e-7.
    """
    return _shift_right(bits, 41).float().add_(0.5).mul_(2.0**-23)


def gumbel_noise(keys: Tensor, vocab: int) -> Tensor:
    """f32[N, V] standard Gumbel noise -log(-log u), u[r, v] = uniform(splitmix64(keys[r], v))."""
    bits = splitmix64(keys[:, None], torch.arange(vocab, device=keys.device))  # [N, V]
    return uniform_from_bits(bits).log_().neg_().log_().neg_()  # [N, V]


def _check(logits: Tensor, keys: Tensor, temperature: float) -> None:
    if logits.dim() != 2 or keys.shape != logits.shape[:1] or keys.dtype != torch.long:
        raise ValueError(f"gumbel_sample: need logits [N, V] and keys i64[N]; got {tuple(logits.shape)} "
                         f"and {keys.dtype}{list(keys.shape)}")
    if not temperature > 0:
        raise ValueError(f"gumbel_sample: temperature must be > 0 (greedy decoding needs no noise); got {temperature}")


def gumbel_sample_reference(logits: Tensor, keys: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """(tokens i64[N], logprobs f32[N]) from `logits` [N, V] with the noise of `keys` i64[N] (torch)."""
    _check(logits, keys, temperature)
    scaled = logits.float() / temperature  # [N, V]
    return argmax_and_logprob(scaled, scaled + gumbel_noise(keys, logits.shape[1]))


def argmax_and_logprob(scaled: Tensor, perturbed: Tensor) -> tuple[Tensor, Tensor]:
    """(tokens i64[N], logprobs f32[N]): tokens = argmax_v perturbed [N, V] (the first maximal index),
    their log-probs under softmax(scaled [N, V]). With perturbed = scaled + Gumbel noise this is the
    draw; the eager sampler, the compiled decode chunk and this reference share it."""
    tokens = perturbed.argmax(dim=-1)  # [N]
    logprobs = scaled.log_softmax(dim=-1).gather(-1, tokens[:, None]).squeeze(-1)  # [N]
    return tokens, logprobs


if triton is not None:

    @triton.jit
    def _gumbel_sample_kernel(logits_ptr, keys_ptr, tokens_ptr, logprobs_ptr, vocab, stride, temperature,
                              BLOCK: tl.constexpr):
        row = tl.program_id(0)
        key = tl.load(keys_ptr + row).to(tl.uint64, bitcast=True)
        base = logits_ptr + row.to(tl.int64) * stride
        best = tl.full((), float("-inf"), tl.float32)
        best_index = tl.full((), 0, tl.int64)
        running_max = tl.full((), float("-inf"), tl.float32)
        running_sum = tl.full((), 0.0, tl.float32)
        for start in range(0, vocab, BLOCK):
            v = start + tl.arange(0, BLOCK)  # [BLOCK]
            valid = v < vocab
            x = tl.load(base + v, mask=valid, other=float("-inf")).to(tl.float32) / temperature  # [BLOCK]
            z = key + (v.to(tl.uint64) + 1) * 0x9E3779B97F4A7C15  # uint64 arithmetic wraps mod 2**64
            z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
            z = (z ^ (z >> 27)) * 0x94D049BB133111EB
            z = z ^ (z >> 31)
            u = ((z >> 41).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # [BLOCK], 2**-23
            perturbed = tl.where(valid, x - tl.log(-tl.log(u)), float("-inf"))  # [BLOCK]
            block_best = tl.max(perturbed, axis=0)
            block_index = tl.argmax(perturbed, axis=0).to(tl.int64) + start  # first maximal index
            take = block_best > best  # strictly greater: an earlier block wins a tie, as torch.argmax
            best_index = tl.where(take, block_index, best_index)
            best = tl.where(take, block_best, best)
            block_max = tl.max(x, axis=0)
            new_max = tl.maximum(running_max, block_max)
            running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
            running_max = new_max
        chosen = tl.load(base + best_index).to(tl.float32) / temperature
        tl.store(tokens_ptr + row, best_index)
        tl.store(logprobs_ptr + row, chosen - running_max - tl.log(running_sum))


def gumbel_sample_triton(logits: Tensor, keys: Tensor, temperature: float, *, block: int | None = None
                         ) -> tuple[Tensor, Tensor]:
    """Triton `gumbel_sample_reference`: one program per row, the vocabulary in blocks of `block`."""
    _check(logits, keys, temperature)
    logits, keys = logits.contiguous(), keys.contiguous()
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.long, device=logits.device)  # [N]
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)  # [N]
    if block is None:  # the interpreter runs a block as numpy arrays: small is cheap there, 4096 fills a GPU's SMs
        block = min(triton.next_power_of_2(vocab), 128 if logits.device.type == "cpu" else 4096)
    if rows:
        _gumbel_sample_kernel[(rows,)](logits, keys, tokens, logprobs, vocab, logits.stride(0), float(temperature),
                                       BLOCK=block)
    return tokens, logprobs
