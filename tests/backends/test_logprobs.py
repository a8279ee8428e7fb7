import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlgraph.backends.local.generation import NativeGenerator
from rlgraph.backends.local.counter_sampling import SamplingParams
from rlgraph.backends.local.logprobs import sequence_logprobs, vocabulary_logprobs
from rlgraph.backends.local.models import build_causal_lm
from rlgraph.data.arithmetic import Problem, to_demonstrations

from tests.backends.conftest import prompts_of

EOS, PAD = 2, 0


def reference_logprobs(model, rollouts, temperature=1.0):
    """(log-probs, entropy) [N, T] from the model's own full-vocabulary logits (no chunking)."""
    width, steps = rollouts.prompt_ids.shape[1], rollouts.response_ids.shape[1]
    ids = torch.cat([rollouts.prompt_ids, rollouts.response_ids], 1)
    mask = torch.cat([rollouts.prompt_mask, rollouts.mask], 1).long()
    logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    logp = (logits[:, width - 1 : width - 1 + steps].float() / temperature).log_softmax(-1)  # [N, T, V]
    picked = logp.gather(-1, rollouts.response_ids[..., None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return picked * rollouts.mask, entropy * rollouts.mask


ragged_texts = st.lists(st.text(alphabet="0123456789+=", min_size=1, max_size=9), min_size=1, max_size=4)


@settings(max_examples=8)
@given(texts=ragged_texts, seed=st.integers(0, 2**16),
       params=st.sampled_from([SamplingParams(1.0, 1.0, 6), SamplingParams(0.7, 0.9, 6), SamplingParams(1.3, 0.5, 5)]))
def test_matches_the_generators_sampling_logprobs(model, tokenizer, texts, seed, params):
    """The PPO ratio is exactly 1 at the first step: recompute == sampling log-probs."""
    ro = NativeGenerator(model, eos_token_id=EOS, pad_token_id=PAD).generate(
        prompts_of(tokenizer, texts), 3, params, seed=seed)
    model.eval()
    try:
        with torch.no_grad():
            lp = sequence_logprobs(model, ro, temperature=params.temperature)
    finally:
        model.train()
    torch.testing.assert_close(lp, ro.logprobs, atol=1e-4, rtol=1e-4)
    assert (lp[~ro.mask] == 0).all()


def test_greedy_rollouts_recomputed_at_temperature_one(model, tokenizer):
    ro = NativeGenerator(model, eos_token_id=EOS, pad_token_id=PAD).generate(
        prompts_of(tokenizer, ["1+2=", "33+44="]), 1, SamplingParams(temperature=0, max_new_tokens=6))
    with torch.no_grad():
        lp = sequence_logprobs(model.eval(), ro)
    model.train()
    torch.testing.assert_close(lp, ro.logprobs, atol=1e-4, rtol=1e-4)


def test_demonstrations_match_full_logits_with_entropy(model, tokenizer):
    demo = to_demonstrations([Problem(1, 2), Problem(50, 60), Problem(7, 93)], tokenizer)
    model.eval()
    try:
        with torch.no_grad():
            lp, entropy = sequence_logprobs(model, demo, temperature=0.8, with_entropy=True)
            expected_lp, expected_entropy = reference_logprobs(model, demo, temperature=0.8)
    finally:
        model.train()
    assert lp.shape == entropy.shape == demo.response_ids.shape
    assert lp.dtype == entropy.dtype == torch.float32
    torch.testing.assert_close(lp, expected_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, expected_entropy, atol=1e-5, rtol=1e-5)
    assert (entropy[~demo.mask] == 0).all() and (entropy[demo.mask] > 0).all()


def test_the_vocabulary_distribution_is_the_full_logits_log_softmax_and_its_picked_entry_the_logprob(model, tokenizer):
    demo = to_demonstrations([Problem(1, 2), Problem(50, 60), Problem(7, 93)], tokenizer)
    model.eval()
    try:
        with torch.no_grad():
            full = vocabulary_logprobs(model, demo, temperature=0.8)  # [N, T, V]
            lp = sequence_logprobs(model, demo, temperature=0.8)  # [N, T]
            ids = torch.cat([demo.prompt_ids, demo.response_ids], 1)
            mask = torch.cat([demo.prompt_mask, demo.mask], 1).long()
            logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    finally:
        model.train()
    width, steps = demo.prompt_ids.shape[1], demo.response_ids.shape[1]
    expected = (logits[:, width - 1 : width - 1 + steps].float() / 0.8).log_softmax(-1) * demo.mask[..., None]
    assert full.shape == (*demo.response_ids.shape, len(tokenizer)) and full.dtype == torch.float32
    torch.testing.assert_close(full, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(full.gather(-1, demo.response_ids[..., None]).squeeze(-1), lp, atol=1e-5, rtol=1e-5)
    assert (full[~demo.mask] == 0).all()
    torch.testing.assert_close(full[demo.mask].exp().sum(-1), torch.ones(int(demo.mask.sum())))


def test_gradients_reach_every_parameter(tokenizer):
    model = build_causal_lm(tokenizer=tokenizer, seed=1)
    demo = to_demonstrations([Problem(1, 2), Problem(50, 60)], tokenizer)
    lp, entropy = sequence_logprobs(model, demo, with_entropy=True)
    (lp.sum() + entropy.sum()).backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name


def test_errors(model, tokenizer):
    demo = to_demonstrations([Problem(1, 2)], tokenizer)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        sequence_logprobs(model, demo, temperature=0.0)
    biased = build_causal_lm(seed=0)
    biased.lm_head = torch.nn.Linear(64, 47, bias=True)
    with pytest.raises(ValueError, match="bias-free linear LM head"):
        sequence_logprobs(biased, demo)
