"""The lean decode step (`rlgraph.backends.local.lean_decode`) against the Hugging Face path.

The contract: for the same (seed, call, prompt index) the lean loop draws the tokens the one-
forward-per-token loop draws, with the same log-probs, and greedy decoding equals
`model.generate(do_sample=False)`.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlgraph.backends.local.generation import NativeGenerator, lean_decoding
from rlgraph.backends.local.counter_sampling import SamplingParams, StepNoise, sampling_keys
from rlgraph.kernels.sampling import gumbel_noise, splitmix64
from rlgraph.backends.local.lean_decode import lean_unsupported
from rlgraph.backends.local.models import build_causal_lm, tiny_config

from tests.backends.conftest import prompts_of
from tests.backends.test_generation import EOS, PAD, TEXTS, with_eos_bias

RAGGED = st.lists(st.text(alphabet="0123456789+=", min_size=1, max_size=9), min_size=1, max_size=4)
PARAMS = [SamplingParams(temperature=1.0, max_new_tokens=8), SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=8),
          SamplingParams(temperature=0.0, max_new_tokens=8)]


def both_paths(model, prompts, n, params, **key):
    """(Hugging Face path, lean path) rollouts of one generate call."""
    hf = NativeGenerator(model, eos_token_id=EOS, pad_token_id=PAD, lean=False).generate(prompts, n, params, **key)
    lean = NativeGenerator(model, eos_token_id=EOS, pad_token_id=PAD, lean=True).generate(prompts, n, params, **key)
    return hf, lean


def assert_same_rollouts(a, b):
    for field in ("prompt_ids", "prompt_mask", "response_ids", "mask", "group"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-6)


@settings(max_examples=6, deadline=None)
@given(texts=RAGGED, seed=st.integers(0, 2**32), call=st.integers(0, 9), n=st.integers(1, 3),
       which=st.integers(0, len(PARAMS) - 1))
def test_lean_draws_the_tokens_of_the_hf_path(model, tokenizer, texts, seed, call, n, which):
    rigged = with_eos_bias(model, 2.0)  # rows stop at different steps, so the mask and padding are checked too
    hf, lean = both_paths(rigged, prompts_of(tokenizer, texts), n, PARAMS[which], seed=seed, call=call)
    assert_same_rollouts(hf, lean)


def test_lean_runs_every_step_to_max_new_tokens(model, tokenizer):
    rigged = with_eos_bias(model, -1e4)  # no row stops: all 12 decode steps run over the static cache
    hf, lean = both_paths(rigged, prompts_of(tokenizer, TEXTS), 2, SamplingParams(max_new_tokens=12), seed=3)
    assert lean.response_ids.shape == (8, 12) and lean.mask.all()
    assert_same_rollouts(hf, lean)


def test_lean_greedy_equals_hf_generate(model, tokenizer):
    prompts = prompts_of(tokenizer, TEXTS)
    lean = NativeGenerator(model, eos_token_id=EOS, pad_token_id=PAD, lean=True).generate(
        prompts, 1, SamplingParams(temperature=0, max_new_tokens=10))
    with torch.no_grad():
        out = model.generate(input_ids=prompts.ids, attention_mask=prompts.mask.long(), do_sample=False,
                             max_new_tokens=10, eos_token_id=EOS, pad_token_id=PAD)
    expected = out[:, prompts.ids.shape[1]:]  # [B, <=10], PAD after each row's EOS
    width = expected.shape[1]
    assert torch.equal(lean.response_ids[:, :width], expected)
    assert (lean.response_ids[:, width:] == PAD).all()


def test_lean_runs_lora_adapters(model, tokenizer):
    """A peft PeftModel: the lean step runs its adapters (it calls the projections as modules)."""
    peft = pytest.importorskip("peft")
    base = build_causal_lm(tokenizer=tokenizer, seed=0)
    base.load_state_dict(model.state_dict())
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)
    lora = peft.get_peft_model(base, config)
    assert lean_unsupported(lora) is None
    prompts, params = prompts_of(tokenizer, TEXTS), SamplingParams(temperature=0, max_new_tokens=6)
    hf, lean = both_paths(lora, prompts, 1, params)
    assert_same_rollouts(hf, lean)
    with lora.disable_adapter():  # the adapters change the greedy answers: the lean step did not skip them
        plain = NativeGenerator(lora, eos_token_id=EOS, pad_token_id=PAD, lean=True).generate(prompts, 1, params)
    assert not torch.equal(plain.logprobs, lean.logprobs)


def test_step_noise_equals_the_per_step_noise():
    keys = sampling_keys(11, 2, torch.arange(3), 2)  # [6]
    for budget in (1, 6 * 5 * 2, 2**20):  # one step a block, two steps a block, all steps at once
        noise = StepNoise(keys, 5, steps=7, budget=budget)
        for step in range(7):
            assert torch.equal(noise.at(step), gumbel_noise(splitmix64(keys, step), 5)), (budget, step)


def test_lean_decoding_context_picks_the_path(model):
    gen = lambda: NativeGenerator(model, eos_token_id=EOS, pad_token_id=PAD)  # noqa: E731
    assert gen().lean
    with lean_decoding(False):
        assert not gen().lean
        assert NativeGenerator(model, eos_token_id=EOS, pad_token_id=PAD, lean=True).lean  # an explicit choice wins
    assert gen().lean


def _variant(tokenizer, **changes):
    return build_causal_lm({**tiny_config(tokenizer), **changes}, tokenizer=tokenizer, seed=0)


@pytest.mark.parametrize("changes, reason", [
    (dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], n_embd=64, n_layer=1, n_head=4, n_positions=64),
     "GPT2LMHeadModel has no .model decoder"),
    (dict(use_sliding_window=True, sliding_window=4, max_window_layers=0), "sliding-window attention"),
    (dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=16), "normalises q and k"),
])
def test_models_the_lean_step_does_not_know_fall_back_and_say_why(tokenizer, changes, reason):
    model = _variant(tokenizer, **changes)
    assert reason in lean_unsupported(model)
    with pytest.raises(ValueError, match=f"lean decode step cannot drive this model: .*{reason}.*\n  fix: pass lean=None"):
        NativeGenerator(model, eos_token_id=EOS, pad_token_id=PAD, lean=True)
    fallback = NativeGenerator(model, eos_token_id=EOS, pad_token_id=PAD)
    assert not fallback.lean
    ro = fallback.generate(prompts_of(tokenizer, TEXTS[:2]), 2, SamplingParams(max_new_tokens=3), seed=1)
    assert ro.response_ids.shape[0] == 4 and ro.mask[:, 0].all()


def test_lean_call_runs_in_eval_mode_and_restores_the_mode(model, tokenizer):
    seen = []  # a hook on a module the lean step calls (one on the root would send it to the HF path)
    handle = model.model.layers[0].mlp.register_forward_pre_hook(lambda module, args: seen.append(module.training))
    try:
        model.train()
        gen = NativeGenerator(model, eos_token_id=EOS, pad_token_id=PAD, lean=True)
        gen.generate(prompts_of(tokenizer, TEXTS), 1, SamplingParams(max_new_tokens=3))
        assert model.training and len(seen) == 3 and not any(seen)  # prefill + 2 decode steps
    finally:
        handle.remove()


def test_hooks_on_a_bypassed_module_send_the_model_to_the_hf_path(model):
    handle = model.model.layers[1].register_forward_pre_hook(lambda module, args: None)
    try:
        assert lean_unsupported(model) == "forward hooks on layer 1, whose forward the lean step does not call"
        assert not NativeGenerator(model, eos_token_id=EOS, pad_token_id=PAD).lean
    finally:
        handle.remove()
    assert lean_unsupported(model) is None


@pytest.mark.parametrize("lean", [True, False])
def test_prefilling_each_prompt_once_decodes_what_prefilling_each_sample_does(model, tokenizer, lean):
    """Each prompt is prefilled once and its cache rows repeated for its n samples; the old path
    prefilled the N = B*n repeated rows. Both decode the same tokens to bit-identical logits: each
    row's prefill is the same arithmetic on the same numbers, whatever else is in the batch."""
    prompts, n, steps = prompts_of(tokenizer, TEXTS), 3, 6
    generator = NativeGenerator(model, eos_token_id=EOS, pad_token_id=PAD, lean=lean)
    ids, mask = prompts.ids, prompts.mask.bool()  # [B, P]
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, P]
    start = generator._lean_start if lean else generator._hf_start
    tokens = torch.randint(3, 20, (steps, len(ids) * n), generator=torch.Generator().manual_seed(0))  # [S, N]
    runs = []
    with torch.no_grad():
        for rows, share in (([ids, mask, positions], n), ([t.repeat_interleave(n, 0) for t in (ids, mask, positions)], 1)):
            logits, advance = start(*rows, steps, share)  # [N, V]
            runs.append(torch.stack([logits] + [advance(token) for token in tokens[:-1]], 1))  # [N, S, V]
    shared, per_sample = runs
    assert shared.shape == (len(ids) * n, steps, model.config.vocab_size)
    assert torch.equal(shared, per_sample)
