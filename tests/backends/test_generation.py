import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlgraph.backends.local.generation import NativeGenerator, SamplingParams, nucleus_filter, sample_tokens
from rlgraph.backends.local.models import build_causal_lm
from rlgraph.batches import Prompts

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


def test_sample_tokens_follows_the_tempered_distribution():
    logits = torch.tensor([0.0, 1.0, 2.0]).expand(20_000, 3)
    tokens, logprobs = sample_tokens(logits, SamplingParams(temperature=2.0), torch.Generator().manual_seed(0))
    expected = (logits[0] / 2.0).softmax(-1)
    assert torch.allclose(torch.bincount(tokens, minlength=3) / 20_000, expected, atol=0.015)
    assert torch.allclose(logprobs, expected.log()[tokens])


# --- NativeGenerator -------------------------------------------------------------------------------

def test_rows_groups_and_meta_are_repeated(model, tokenizer):
    prompts = prompts_of(tokenizer, TEXTS)
    ro = NativeGenerator(model, eos_token_id=EOS, pad_token_id=PAD).generate(
        prompts, 3, SamplingParams(max_new_tokens=4), generator=torch.Generator().manual_seed(0))
    assert len(ro) == 12
    assert ro.group.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert torch.equal(ro.prompt_ids, prompts.ids.repeat_interleave(3, 0))
    assert torch.equal(ro.prompt_mask, prompts.mask.repeat_interleave(3, 0))
    assert ro.meta["text"] == [t for t in TEXTS for _ in range(3)]
    assert ro.response_ids.dtype == torch.long and ro.mask.dtype == torch.bool and ro.logprobs.dtype == torch.float32


def test_same_generator_seed_same_rollouts(model, tokenizer):
    gen = NativeGenerator(model, eos_token_id=EOS, pad_token_id=PAD)
    prompts, params = prompts_of(tokenizer, TEXTS), SamplingParams(temperature=1.5, top_p=0.9, max_new_tokens=8)
    a = gen.generate(prompts, 4, params, generator=torch.Generator().manual_seed(7))
    b = gen.generate(prompts, 4, params, generator=torch.Generator().manual_seed(7))
    c = gen.generate(prompts, 4, params, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.response_ids, c.response_ids)


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
        prompts_of(tokenizer, TEXTS), 2, SamplingParams(max_new_tokens=7), generator=torch.Generator().manual_seed(0))
    assert ro.response_ids.shape == (8, 7) and ro.mask.all() and (ro.response_ids != EOS).all()


@settings(max_examples=10)
@given(texts=ragged_texts, seed=st.integers(0, 2**16), n=st.integers(1, 3))
def test_eos_mask_and_padding_invariants(model, tokenizer, texts, seed, n):
    rigged = with_eos_bias(model, 2.5)  # EOS likely but not certain: rows stop at different steps
    ro = NativeGenerator(rigged, eos_token_id=EOS, pad_token_id=PAD).generate(
        prompts_of(tokenizer, texts), n, SamplingParams(max_new_tokens=6),
        generator=torch.Generator().manual_seed(seed))
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
        prompts_of(tokenizer, texts), 2, params, generator=torch.Generator().manual_seed(seed))
    expected = (full_forward_logits(model, ro) / 0.7).log_softmax(-1)  # full vocabulary, no top-p renormalisation
    expected = expected.gather(-1, ro.response_ids[..., None]).squeeze(-1) * ro.mask
    torch.testing.assert_close(ro.logprobs, expected, atol=1e-5, rtol=1e-5)


def test_tiny_top_p_is_greedy(model, tokenizer):
    gen = NativeGenerator(model, eos_token_id=EOS, pad_token_id=PAD)
    prompts = prompts_of(tokenizer, TEXTS)
    greedy = gen.generate(prompts, 2, SamplingParams(temperature=0, max_new_tokens=6))
    nucleus = gen.generate(prompts, 2, SamplingParams(temperature=1.0, top_p=1e-6, max_new_tokens=6),
                           generator=torch.Generator().manual_seed(0))
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
