import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from rlgraph.backends.local.executor import decode_responses
from rlgraph.backends.local.generation import NativeGenerator, PromptError, cut_at_stop
from rlgraph.backends.local.counter_sampling import (
    SamplingParams, SamplingStream, as_int64, nucleus_filter, sample_tokens, sampling_keys,
)
from rlgraph.kernels.sampling import splitmix64, uniform_from_bits
from rlgraph.backends.protocols import RewardRef
from rlgraph.backends.local.models import build_causal_lm
from rlgraph.batches import Prompts, Rollouts
from rlgraph.testing import tiny_executor, tiny_prompts

from tests.backends.conftest import prompts_of

EOS, PAD = 2, 0


def with_eos_bias(model, bias):
    """A copy of `model` whose LM head adds `bias` to the EOS logit (untied from the embedding)."""
    rigged = build_causal_lm(seed=0)
    rigged.load_state_dict(model.state_dict())
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[EOS] = bias
    rigged.lm_head = head
    return rigged


def full_forward_logits(model, rollouts):
    """Logits [N, T, V] predicting each response token, from one forward without a KV cache."""
    width = rollouts.prompt_ids.shape[1]
    ids = torch.cat([rollouts.prompt_ids, rollouts.response_ids], 1)
    mask = torch.cat([rollouts.prompt_mask, rollouts.mask], 1).long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model.eval()(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    model.train()
    return logits[:, width - 1 : width - 1 + rollouts.response_ids.shape[1]].float()


TEXTS = ["1+2=", "12+34=", "99+9=", "5+55="]
ragged_texts = st.lists(st.text(alphabet="0123456789+=", min_size=1, max_size=9), min_size=1, max_size=4)


# --- SamplingParams and the sampling helpers ------------------------------------------------------

def test_sampling_params_validation():
    assert SamplingParams(temperature=0).greedy
    for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(max_new_tokens=0),
                dict(max_new_tokens=2.5)):
        with pytest.raises((ValueError, TypeError)):
            SamplingParams(**bad)


def test_nucleus_filter_keeps_smallest_set_reaching_top_p():
    logits = torch.tensor([[0.2, 0.5, 0.3]]).log()
    kept = lambda top_p: torch.isfinite(nucleus_filter(logits, top_p))[0].tolist()  # noqa: E731
    assert kept(0.5) == [False, True, False]
    assert kept(0.6) == [False, True, True]
    assert kept(0.81) == [True, True, True]
    assert kept(1e-9) == [False, True, False]


# --- counter-based noise -------------------------------------------------------------------------

def splitmix64_reference(key: int, counter: int) -> int:
    """splitmix64 on Python ints mod 2**64: the spec the int64 tensor version must match bit for bit."""
    z = (key + (counter + 1) * 0x9E3779B97F4A7C15) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return z ^ (z >> 31)


def test_splitmix64_matches_the_unsigned_reference():
    assert int(splitmix64(torch.tensor(0), 0)) == as_int64(0xE220A8397B1DCDAF)  # splitmix64(seed 0), first output
    keys = [0, 1, -1, 2**63 - 1, -(2**63), 0x0123456789ABCDEF, -987654321]
    counters = [0, 1, 5, 2**40, 2**62]
    got = splitmix64(torch.tensor(keys)[:, None], torch.tensor(counters)[None])  # [K, C]
    for i, key in enumerate(keys):
        for j, counter in enumerate(counters):
            assert int(got[i, j]) == as_int64(splitmix64_reference(key % 2**64, counter)), (key, counter)


def test_noise_words_are_distinct_and_uniforms_uniform():
    # every (call, prompt, sample, step, vocab id) of a small run: 2*64*4*8*47 = 192,512 words
    keys = torch.cat([sampling_keys(5, call, torch.arange(64), 4) for call in (0, 1)])  # [512]
    steps = splitmix64(keys[:, None], torch.arange(8)).reshape(-1)  # [4096]
    words = splitmix64(steps[:, None], torch.arange(47)).reshape(-1)  # [192512]
    assert len(torch.unique(words)) == len(words)
    u = uniform_from_bits(words)  # [192512]
    assert u.dtype == torch.float32 and 0 < u.min() and u.max() < 1
    assert abs(u.mean() - 0.5) < 3e-3 and abs(u.var() - 1 / 12) < 3e-3
    counts = torch.histc(u, bins=16, min=0, max=1)  # about 12,032 each, sd about 106
    assert (counts - len(u) / 16).abs().max() < 600
    neighbours = torch.corrcoef(uniform_from_bits(words.reshape(-1, 47))[:, :2].T)[0, 1]  # vocab v vs v+1
    assert abs(neighbours) < 0.02


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (2.0, 1.0), (0.7, 0.8)])
def test_sample_tokens_follows_the_filtered_tempered_softmax(temperature, top_p):
    """Gumbel-max draws match softmax(nucleus_filter(logits / T)): chi-square over 40,000 rows."""
    rows, logits = 40_000, torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5])
    params = SamplingParams(temperature=temperature, top_p=top_p)
    keys = splitmix64(sampling_keys(3, 0, torch.arange(rows), 1), 0)  # [R]
    tokens, logprobs = sample_tokens(logits.expand(rows, 5), params, keys)
    expected = nucleus_filter((logits / temperature)[None], top_p)[0].softmax(-1)  # [V]
    counts = torch.bincount(tokens, minlength=5).double()  # [V]
    kept = expected > 0
    assert (counts[~kept] == 0).all()
    chi2 = ((counts - rows * expected)[kept] ** 2 / (rows * expected[kept])).sum()
    assert chi2 < 25, f"chi-square {chi2:.1f} on {int(kept.sum()) - 1} degrees of freedom (p < 1e-4 above 25)"
    assert torch.allclose(logprobs, (logits / temperature).log_softmax(-1)[tokens])  # full-vocabulary log-probs


def test_sampling_stream_counts_calls():
    stream = SamplingStream(seed=9)
    assert [stream.advance(), stream.advance(), stream.calls] == [0, 1, 2]


# --- NativeGenerator -------------------------------------------------------------------------------

def test_rows_groups_and_meta_are_repeated(model, tokenizer):
    prompts = prompts_of(tokenizer, TEXTS)
    ro = NativeGenerator(model, eos_token_id=EOS, pad_token_id=PAD).generate(
        prompts, 3, SamplingParams(max_new_tokens=4), seed=0)
    assert len(ro) == 12
    assert ro.group.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert torch.equal(ro.prompt_ids, prompts.ids.repeat_interleave(3, 0))
    assert torch.equal(ro.prompt_mask, prompts.mask.repeat_interleave(3, 0))
    assert ro.meta["text"] == [t for t in TEXTS for _ in range(3)]
    assert ro.response_ids.dtype == torch.long and ro.mask.dtype == torch.bool and ro.logprobs.dtype == torch.float32


def test_same_seed_and_call_same_rollouts(model, tokenizer):
    gen = NativeGenerator(model, eos_token_id=EOS, pad_token_id=PAD)
    prompts, params = prompts_of(tokenizer, TEXTS), SamplingParams(temperature=1.5, top_p=0.9, max_new_tokens=8)
    a = gen.generate(prompts, 4, params, seed=7, call=3)
    b = gen.generate(prompts, 4, params, seed=7, call=3)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)
    for other in (dict(seed=8, call=3), dict(seed=7, call=4)):
        assert not torch.equal(a.response_ids, gen.generate(prompts, 4, params, **other).response_ids), other
    moved = Prompts(prompts.ids, prompts.mask, prompts.meta, prompts.index + 100)  # same texts, other identities
    assert not torch.equal(a.response_ids, gen.generate(moved, 4, params, seed=7, call=3).response_ids)


SHARDED = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=5)


cuts = st.integers(2, 7).flatmap(lambda rows: st.tuples(st.just(rows), st.integers(1, rows - 1)))  # (B, k)


@settings(max_examples=12, deadline=None)
@given(cut=cuts, n=st.integers(1, 3), seed=st.integers(0, 2**32), call=st.integers(0, 50))
@example(cut=(5, 2), n=3, seed=0, call=0)
@example(cut=(6, 1), n=2, seed=123, call=7)
def test_sharded_generation_equals_whole(cut, n, seed, call):
    """Generating prompts[0:k] and prompts[k:B] (on two ranks, say) gives the rows of generating all B.

    The sampling noise is bit-identical; the model's logits are not quite: CPU BLAS picks its
    kernel by row count (a GEMV for one row), so log-probs may differ in the last bit or two.
    """
    rows, k = cut
    executor, prompts = tiny_executor(), tiny_prompts(rows)
    gen = NativeGenerator(executor.models["policy"].model, eos_token_id=EOS, pad_token_id=PAD)
    whole = gen.generate(prompts, n, SHARDED, seed=seed, call=call)
    parts = [gen.generate(prompts.select(range(lo, hi)), n, SHARDED, seed=seed, call=call)
             for lo, hi in ((0, k), (k, rows))]
    assert torch.equal(torch.cat([parts[0].group, parts[1].group + k]), whole.group)  # shard-local ids, offset
    joined = Rollouts.concat(parts, pad_id=PAD)  # pads the shards to one T
    for field in ("prompt_ids", "prompt_mask", "response_ids", "mask"):
        assert torch.equal(getattr(joined, field), getattr(whole, field)), field
    torch.testing.assert_close(joined.logprobs, whole.logprobs, rtol=0, atol=1e-6)


def test_ranks_of_one_seed_generate_the_shards_of_one_batch():
    """Executors with one seed making the same calls: rank r's shard is rows of the single-process batch."""
    prompts, ranks = tiny_prompts(6), [tiny_executor() for _ in range(3)]
    single = tiny_executor()
    for _ in range(2):  # the second call draws new samples, on every rank alike
        whole = single.generate(single.current("policy"), prompts, n=2, top_p=0.9)
        shards = [rank.generate(rank.current("policy"), prompts.select(range(2 * r, 2 * r + 2)), n=2, top_p=0.9)
                  for r, rank in enumerate(ranks)]
        joined = Rollouts.concat(shards, pad_id=PAD)
        assert torch.equal(joined.response_ids, whole.response_ids) and torch.equal(joined.mask, whole.mask)
        torch.testing.assert_close(joined.logprobs, whole.logprobs, rtol=0, atol=1e-6)  # see above: BLAS by row count
    assert single.sampling == ranks[0].sampling == SamplingStream(seed=0, calls=2)


def test_model_mode_is_eval_during_the_call_and_restored(model, tokenizer):
    seen = []
    handle = model.register_forward_pre_hook(lambda module, args: seen.append(module.training))
    try:
        model.train()
        NativeGenerator(model, eos_token_id=EOS, pad_token_id=PAD).generate(
            prompts_of(tokenizer, TEXTS), 1, SamplingParams(max_new_tokens=2))
        assert model.training and seen and not any(seen)
        model.eval()
        NativeGenerator(model, eos_token_id=EOS, pad_token_id=PAD).generate(
            prompts_of(tokenizer, TEXTS), 1, SamplingParams(max_new_tokens=2))
        assert not model.training
    finally:
        handle.remove()
        model.train()


def test_certain_eos_stops_after_one_token(model, tokenizer):
    rigged = with_eos_bias(model, 1e4)
    ro = NativeGenerator(rigged, eos_token_id=EOS, pad_token_id=PAD).generate(
        prompts_of(tokenizer, TEXTS), 2, SamplingParams(max_new_tokens=10))
    assert ro.response_ids.tolist() == [[EOS]] * 8
    assert ro.mask.all() and torch.allclose(ro.logprobs, torch.zeros(8, 1), atol=1e-6)


def test_impossible_eos_runs_to_max_new_tokens(model, tokenizer):
    rigged = with_eos_bias(model, -1e4)
    ro = NativeGenerator(rigged, eos_token_id=EOS, pad_token_id=PAD).generate(
        prompts_of(tokenizer, TEXTS), 2, SamplingParams(max_new_tokens=7), seed=0)
    assert ro.response_ids.shape == (8, 7) and ro.mask.all() and (ro.response_ids != EOS).all()


@settings(max_examples=10)
@given(texts=ragged_texts, seed=st.integers(0, 2**16), n=st.integers(1, 3))
def test_eos_mask_and_padding_invariants(model, tokenizer, texts, seed, n):
    rigged = with_eos_bias(model, 2.5)  # EOS likely but not certain: rows stop at different steps
    ro = NativeGenerator(rigged, eos_token_id=EOS, pad_token_id=PAD).generate(
        prompts_of(tokenizer, texts), n, SamplingParams(max_new_tokens=6),
        seed=seed)
    lengths = ro.mask.sum(1)  # [N]
    steps = ro.response_ids.shape[1]
    assert 1 <= steps <= 6 and lengths.max() == steps
    assert torch.equal(ro.mask, torch.arange(steps)[None] < lengths[:, None])  # a prefix of each row
    is_eos = ro.response_ids == EOS
    for row in range(len(ro)):
        length = int(lengths[row])
        eos_at = is_eos[row, :length].nonzero().flatten().tolist()
        assert eos_at in ([length - 1], []) and (eos_at or length == 6)
    assert (ro.response_ids[~ro.mask] == PAD).all() and (ro.logprobs[~ro.mask] == 0).all()
    assert (ro.logprobs[ro.mask] <= 0).all()


@settings(max_examples=8)
@given(texts=ragged_texts)
def test_greedy_matches_a_forward_without_cache(model, tokenizer, texts):
    rigged = with_eos_bias(model, -1e4)  # keep every row running so each step is checked
    ro = NativeGenerator(rigged, eos_token_id=EOS, pad_token_id=PAD).generate(
        prompts_of(tokenizer, texts), 1, SamplingParams(temperature=0, max_new_tokens=8))
    logits = full_forward_logits(rigged, ro)  # [N, T, V]
    assert torch.equal(ro.response_ids, logits.argmax(-1))
    expected = logits.log_softmax(-1).gather(-1, ro.response_ids[..., None]).squeeze(-1)
    torch.testing.assert_close(ro.logprobs, expected, atol=1e-5, rtol=1e-5)


@settings(max_examples=5)
@given(texts=ragged_texts, seed=st.integers(0, 2**16))
def test_sampled_logprobs_match_a_forward_without_cache(model, tokenizer, texts, seed):
    params = SamplingParams(temperature=0.7, top_p=0.8, max_new_tokens=6)
    ro = NativeGenerator(model, eos_token_id=EOS, pad_token_id=PAD).generate(
        prompts_of(tokenizer, texts), 2, params, seed=seed)
    expected = (full_forward_logits(model, ro) / 0.7).log_softmax(-1)  # full vocabulary, no top-p renormalisation
    expected = expected.gather(-1, ro.response_ids[..., None]).squeeze(-1) * ro.mask
    torch.testing.assert_close(ro.logprobs, expected, atol=1e-5, rtol=1e-5)


def test_tiny_top_p_is_greedy(model, tokenizer):
    gen = NativeGenerator(model, eos_token_id=EOS, pad_token_id=PAD)
    prompts = prompts_of(tokenizer, TEXTS)
    greedy = gen.generate(prompts, 2, SamplingParams(temperature=0, max_new_tokens=6))
    nucleus = gen.generate(prompts, 2, SamplingParams(temperature=1.0, top_p=1e-6, max_new_tokens=6),
                           seed=0)
    assert torch.equal(greedy.response_ids, nucleus.response_ids)
    torch.testing.assert_close(greedy.logprobs, nucleus.logprobs)


def test_bad_inputs(model, tokenizer):
    gen = NativeGenerator(model, eos_token_id=EOS, pad_token_id=PAD)
    prompts = prompts_of(tokenizer, TEXTS)
    with pytest.raises(ValueError, match="n .* must be >= 1"):
        gen.generate(prompts, 0, SamplingParams())
    right_padded = Prompts(prompts.ids.flip(1), prompts.mask.flip(1))
    with pytest.raises(ValueError, match="left-padded"):
        gen.generate(right_padded, 1, SamplingParams())


def _prompts(ids, mask=None):
    ids = torch.as_tensor(ids)
    return Prompts(ids, torch.ones(ids.shape, dtype=torch.bool) if mask is None else mask, {})


@pytest.mark.parametrize("ids, message", [
    ([[5.0, 6.0]], "prompt ids are torch.float32, not token ids"),
    ([[True, False]], "prompt ids are torch.bool"),
    ([[5, 6], [7, 10**6]], r"prompt row 1 \(batch index 1\) holds token ids \[1000000\] outside the model's vocabulary"),
    ([[-1, 6]], r"prompt row 0 .* holds token ids \[-1\]"),
])
def test_prompts_a_model_cannot_read_are_refused_naming_the_row(model, ids, message):
    with pytest.raises(PromptError, match=message):
        NativeGenerator(model, eos_token_id=EOS, pad_token_id=PAD).generate(_prompts(ids), 1, SamplingParams(max_new_tokens=2))



# -- stop strings ---------------------------------------------------------------------------------
def rollouts_of(rows: list[list[int]], lengths: list[int]) -> Rollouts:
    """Rollouts with responses `rows` (all of one width), the first `lengths[i]` tokens of row i live."""
    ids = torch.tensor(rows)  # [N, T]
    mask = torch.arange(ids.shape[1])[None, :] < torch.tensor(lengths)[:, None]  # [N, T]
    logprobs = torch.full(ids.shape, -0.5).masked_fill(~mask, 0.0)  # [N, T]
    count = len(rows)
    return Rollouts(torch.ones(count, 1, dtype=torch.long), torch.ones(count, 1, dtype=torch.bool), ids, mask, logprobs,
                    torch.arange(count), {})


def test_a_stop_string_spanning_tokens_ends_the_response_after_the_token_completing_it():
    vocab = {1: "ab", 2: "c\n", 3: "\nd", 4: "e", 5: "\n\n"}
    decode = lambda ids: "".join(vocab[i] for i in ids)  # noqa: E731 - a toy multi-character tokenizer
    ro = rollouts_of([[1, 2, 3, 4], [1, 4, 4, 4], [5, 1, 4, 4], [1, 4, 2, 3]], lengths=[4, 4, 4, 3])
    cut = cut_at_stop(ro, ["\n\n", "zz"], decode, pad_id=0)
    # row 0: "ab" "c\n" "\nd" -> the third token completes "\n\n"; row 1 has none; row 2 stops at once;
    # row 3 would complete it with its 4th token, which is already masked (after an EOS)
    assert cut.mask.sum(1).tolist() == [3, 4, 1, 3]
    assert cut.response_ids.tolist() == [[1, 2, 3, 0], [1, 4, 4, 4], [5, 0, 0, 0], [1, 4, 2, 0]]
    assert torch.equal(cut.logprobs, torch.full((4, 4), -0.5).masked_fill(~cut.mask, 0.0))
    assert cut_at_stop(ro, [], decode, pad_id=0) is ro


def test_stop_strings_cut_generated_completions_and_the_rewards_read_the_cut_text():
    seen = []

    def recorder(completions, **_):
        seen.extend(completions)
        return [0.0] * len(completions)

    prompts = tiny_prompts(4)
    full = tiny_executor(reward=recorder, max_new_tokens=8)
    ro = full.generate(full.current("policy"), prompts, n=4, temperature=1.0)
    texts = decode_responses(full.tokenizer, ro)
    stop = next(text[2] for text in texts if len(text) > 3)  # a character some response has mid-way
    cut_executor = tiny_executor(reward=recorder, max_new_tokens=8)  # same seed and call: the same samples
    cut = cut_executor.generate(cut_executor.current("policy"), prompts, n=4, temperature=1.0, stop=(stop,))
    cut_executor.score(RewardRef("reward"), cut)
    expected = [text[: text.index(stop) + 1] if stop in text else text for text in texts]
    assert seen == expected and any(len(a) < len(b) for a, b in zip(expected, texts))
    # a character tokenizer: a cut row keeps one token per character of its cut text; the others are as they were
    assert cut.mask.sum(1).tolist() == [len(cut_text) if stop in text else int(ro.mask[i].sum())
                                        for i, (text, cut_text) in enumerate(zip(texts, expected))]
    assert cut.response_ids.shape == ro.response_ids.shape  # static T
    assert torch.equal(cut.logprobs, ro.logprobs.masked_fill(~cut.mask, 0.0))


def test_top_p_one_samples_what_no_top_p_samples():
    prompts = tiny_prompts(4)
    plain, nucleus = tiny_executor(max_new_tokens=6), tiny_executor(max_new_tokens=6)
    a = plain.generate(plain.current("policy"), prompts, n=2, temperature=1.0)
    b = nucleus.generate(nucleus.current("policy"), prompts, n=2, temperature=1.0, top_p=1.0)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)


@pytest.mark.parametrize("stop", [("",), ("a", ""), (3,)])
def test_bad_stop_strings_are_refused(stop):
    with pytest.raises(ValueError, match="SamplingParams.stop must hold non-empty strings"):
        SamplingParams(stop=stop)


# ----------------------------------------------------------------------------- the fused sampler and the host syncs


def test_the_fused_sampling_kernel_draws_what_the_torch_sampler_draws(monkeypatch, model, tokenizer):
    """On a GPU temperature sampling runs `rlgraph.kernels.sampling`'s Triton kernel; here it runs under
    the Triton interpreter (tests/conftest.py) by letting the engine use it on the CPU. The tokens are
    the same draws; the log-probs differ only in how the softmax's sum is ordered (float32 rounding
    of a sum over V terms: (V + 4) * 2**-24 per side, see tests/kernels/test_sampling.py)."""
    from rlgraph.backends.local import generation

    prompts = prompts_of(tokenizer, TEXTS)
    params = SamplingParams(temperature=0.9, max_new_tokens=6)
    want = NativeGenerator(model, eos_token_id=EOS, pad_token_id=PAD).generate(prompts, 3, params, seed=5, call=2)
    monkeypatch.setattr(generation, "FUSED_SAMPLING_DEVICES", ("cpu",))
    got = NativeGenerator(model, eos_token_id=EOS, pad_token_id=PAD).generate(prompts, 3, params, seed=5, call=2)
    assert torch.equal(got.response_ids, want.response_ids) and torch.equal(got.mask, want.mask)
    vocab = model.get_input_embeddings().num_embeddings
    assert (got.logprobs - want.logprobs).abs().max() <= 2 * (vocab + 4) * 2.0**-24


def test_checking_for_finished_rows_every_k_steps_gives_the_same_rollouts(monkeypatch, model, tokenizer):
    """A GPU checks "all rows finished?" every FINISHED_CHECK_EVERY steps (a host sync each): the extra
    steps only append masked columns, which are trimmed, so the rollouts are the same."""
    from rlgraph.backends.local import generation

    model = with_eos_bias(model, 4.0)  # rows end early, at different steps
    prompts, params = prompts_of(tokenizer, TEXTS), SamplingParams(temperature=1.0, max_new_tokens=12)
    want = NativeGenerator(model, eos_token_id=EOS, pad_token_id=PAD).generate(prompts, 2, params, seed=1)
    assert want.response_ids.shape[1] < 12, "the case needs rows that all finish before max_new_tokens"
    assert want.response_ids.shape[1] % 5, "and past a check, so the later check decodes extra (trimmed) steps"
    monkeypatch.setattr(generation, "finished_check_every", lambda device: 5)
    got = NativeGenerator(model, eos_token_id=EOS, pad_token_id=PAD).generate(prompts, 2, params, seed=1)
    for field in ("response_ids", "mask", "logprobs", "group"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
