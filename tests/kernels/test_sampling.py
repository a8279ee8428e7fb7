"""The fused sampling kernel (hash -> Gumbel -> temperature -> argmax -> log-prob) against its torch
reference, and the reference against the generation engine's sampler (run under TRITON_INTERPRET=1).

Log-prob tolerance, from the arithmetic: both sides compute logit_t / T - logsumexp(logits / T) in
float32 and differ only in how the V exponentials are summed (torch's vectorised order vs the
kernel's blocked running sum) and in their `exp`/`log`. A float32 sum of V positive terms carries a
relative error of at most (V - 1) eps, each exp and the log another eps or two, so the two
log-sum-exps differ by at most about (V + 4) eps in absolute terms (eps = 2**-24), per side: the
bound below is twice that.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlgraph.backends.local.counter_sampling import SamplingParams, sample_tokens
from rlgraph.kernels.sampling import gumbel_noise, gumbel_sample_reference, gumbel_sample_triton, splitmix64

EPS = 2.0**-24


def logprob_tolerance(vocab: int) -> float:
    return 2 * (vocab + 4) * EPS


def case(rows: int, vocab: int, seed: int, *, scale: float = 3.0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen) * scale).to(dtype)  # [N, V]
    keys = splitmix64(torch.tensor(seed), torch.arange(rows))  # [N]
    return logits, keys


def assert_same_draw(logits, keys, temperature, **kwargs):
    want_tokens, want_lp = gumbel_sample_reference(logits, keys, temperature)
    got_tokens, got_lp = gumbel_sample_triton(logits, keys, temperature, **kwargs)
    assert torch.equal(got_tokens, want_tokens)
    assert (got_lp - want_lp).abs().max() <= logprob_tolerance(logits.shape[1])


def test_the_reference_is_the_generation_engines_sampler():
    logits, keys = case(6, 50, seed=1)
    for temperature in (0.6, 1.0, 1.7):
        want = sample_tokens(logits, SamplingParams(temperature=temperature), keys)
        got = gumbel_sample_reference(logits, keys, temperature)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])  # the same ops, bit for bit


@pytest.mark.parametrize("vocab, block", [(7, 16), (128, 32), (301, 64), (1000, 128)])
@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.3])
def test_the_kernel_draws_the_references_tokens(vocab, block, temperature):
    logits, keys = case(5, vocab, seed=vocab)
    assert_same_draw(logits, keys, temperature, block=block)


def test_bf16_logits_are_read_as_they_are_and_computed_in_float32():
    logits, keys = case(4, 200, seed=3, dtype=torch.bfloat16)
    assert_same_draw(logits, keys, 1.0, block=64)


def test_a_row_whose_logits_are_one_hot_draws_that_token_with_log_prob_zero():
    logits = torch.full((3, 40), -1e4)
    logits[torch.arange(3), torch.tensor([0, 17, 39])] = 0.0  # first, middle, last token of the vocabulary
    tokens, logprobs = gumbel_sample_triton(logits, splitmix64(torch.tensor(5), torch.arange(3)), 1.0, block=16)
    assert tokens.tolist() == [0, 17, 39] and logprobs.abs().max() == 0.0


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 4), vocab=st.integers(1, 300), seed=st.integers(0, 2**31),
       temperature=st.floats(0.3, 2.0), block=st.sampled_from([16, 64, 128]))
def test_any_shape_draws_the_same_tokens(rows, vocab, seed, temperature, block):
    logits, keys = case(rows, vocab, seed)
    assert_same_draw(logits, keys, temperature, block=block)


def test_the_draws_follow_the_softmax():
    """Gumbel-max is an exact sampler: over 20,000 keys the token frequencies match softmax(logits / T)
    within 5 standard errors of a binomial proportion (sqrt(p (1 - p) / n) <= 0.0036)."""
    logits, temperature, n = torch.tensor([[2.0, 1.0, 0.0, -1.0]]), 0.8, 20_000
    keys = splitmix64(torch.tensor(11), torch.arange(n))  # [n]
    tokens, _ = gumbel_sample_reference(logits.expand(n, -1), keys, temperature)
    freq = torch.bincount(tokens, minlength=4).float() / n  # [4]
    probs = (logits[0] / temperature).softmax(-1)  # [4]
    assert ((freq - probs).abs() <= 5 * (probs * (1 - probs) / n).sqrt()).all(), (freq, probs)


def test_the_noise_of_a_token_depends_only_on_its_key_and_index():
    keys = splitmix64(torch.tensor(2), torch.arange(3))
    assert torch.equal(gumbel_noise(keys, 10)[:, :4], gumbel_noise(keys, 4))  # a larger vocabulary extends it
    assert torch.equal(gumbel_noise(keys[1:], 10), gumbel_noise(keys, 10)[1:])  # rows are independent
    assert math.isfinite(float(gumbel_noise(keys, 1000).abs().max()))


@pytest.mark.parametrize("fn", [gumbel_sample_reference, gumbel_sample_triton])
def test_bad_arguments_are_named(fn):
    logits, keys = case(2, 8, seed=0)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        fn(logits, keys, 0.0)
    with pytest.raises(ValueError, match=r"keys i64\[N\]; got .*torch.int32"):
        fn(logits, keys.int(), 1.0)
    with pytest.raises(ValueError, match=r"logits \[N, V\]"):
        fn(logits[0], keys, 1.0)
