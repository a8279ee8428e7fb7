"""When the decode step compiles (`rlgraph.backends.local.decode_compile`): the auto rule's
arithmetic, the measured compiles it reads back, the bad values it refuses; and, slow, the compiled
decode wired into the executor: eager tokens, one compile per shape per run, the on-disk cache reused."""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlgraph.backends.local import decode_compile as dc
from rlgraph.backends.local.decode_compile import CompileLedger, DecodeCompile, padded_width, step_saving
from rlgraph.backends.local.state import LMWorker
from rlgraph.backends.local.executor import LocalExecutor, RewardWorker
from rlgraph.backends.local.models import build_causal_lm
from rlgraph.errors import ConfigError

from tests.backends.conftest import prompts_of

SHAPE = dict(rows=64, width=16, steps=64, layers=2, device="cpu", signature="tiny")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A fresh Inductor cache directory (its records file with it)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    return tmp_path / "inductor"


def test_on_and_off_decide_without_arithmetic(cache_dir):
    assert CompileLedger(DecodeCompile("on")).decide(**SHAPE).compile
    assert not CompileLedger(DecodeCompile("off")).decide(**SHAPE).compile
    assert CompileLedger(DecodeCompile("off")).decide(**SHAPE).text() == "decode eager: generation.compile=off"


def test_auto_compiles_when_the_projected_saving_exceeds_a_cold_compile(cache_dir):
    per_step = (dc.CPU_SAVING_PER_LAYER_S + dc.CPU_SAVING_PER_ROW_LAYER_S * 64) * 2  # 2.07 ms
    assert step_saving(64, 2, "cpu") == pytest.approx(per_step) and per_step > 0
    cold = dc.cold_compile(2, 8)  # the prefill and a chunk of 8 steps, 2 layers
    repaying = int(cold / (64 * per_step)) + 1  # the fewest calls whose saving passes the compile
    short, long = (CompileLedger(DecodeCompile("auto", calls={64: calls})).decide(**SHAPE)
                   for calls in (repaying - 1, repaying))
    assert not short.compile and long.compile
    assert f"{repaying} calls x 64 steps x {per_step * 1e3:.3f} ms" in long.reason
    assert f"> cold compile ~{cold:.0f} s" in long.reason
    assert "<= cold compile" in short.reason
    unprojected = CompileLedger(DecodeCompile("auto", calls={8: 10**6})).decide(**SHAPE)  # another number of rows
    assert not unprojected.compile and "0 calls" in unprojected.reason


def test_auto_reads_the_compile_measured_before_in_this_cache_directory(cache_dir):
    """A shape that compiled before in this cache directory compiles warm (Inductor serves it from
    disk): the recorded seconds, not the cold estimate, are what the saving must repay."""
    policy = DecodeCompile("auto", calls={64: 200})  # 200 x 64 x 2.07 ms = 26 s saved: short of a cold 147 s
    assert not CompileLedger(policy).decide(**SHAPE).compile
    ledger = CompileLedger(DecodeCompile("on"))
    ledger.compiled((64, 80, 8), 0.5, signature="tiny", device="cpu")  # rows 64, cache 16 + 64 columns, k = 8
    assert json.loads((cache_dir / dc.RECORD_FILE).read_text()) == {"tiny|cpu|64x80x8": [0.5]}
    warm = CompileLedger(policy).decide(**SHAPE)
    assert warm.compile and "compiled before" in warm.reason and "0.5 s" in warm.reason
    assert ledger.compiles == {(64, 80, 8): 1} and ledger.pop_seconds() == 0.5 and ledger.pop_seconds() == 0.0


def test_the_saving_is_not_extrapolated_past_the_rows_measured(cache_dir):
    """The fit grows with the rows over the 8-128 measured; past 128 rows it is the 128-row saving."""
    assert step_saving(8, 2, "cpu") < step_saving(64, 2, "cpu") < step_saving(128, 2, "cpu")
    assert step_saving(512, 2, "cpu") == step_saving(dc.CPU_SAVING_ROWS_MEASURED, 2, "cpu")


def test_auto_never_compiles_where_the_compiled_decode_is_slower(cache_dir, monkeypatch):
    """Were the compiled decode slower at some rows (a saving <= 0), no run would be long enough."""
    monkeypatch.setattr(dc, "CPU_SAVING_PER_ROW_LAYER_S", -1e-5)
    assert step_saving(128, 2, "cpu") < 0
    decision = CompileLedger(DecodeCompile("auto", calls={128: 10**9})).decide(**{**SHAPE, "rows": 128})
    assert not decision.compile and "the compiled step is not faster" in decision.reason


def test_auto_says_when_the_run_projects_no_calls_rather_than_blaming_the_rows(cache_dir):
    """A run bounded by seconds (the demo) projects no calls: the decision says that, not that the rows are too many."""
    decision = CompileLedger(DecodeCompile("auto")).decide(**SHAPE)
    assert not decision.compile and "projects no generate calls" in decision.reason
    assert "not faster" not in decision.reason


def test_a_decision_is_made_once_per_shape(cache_dir):
    ledger = CompileLedger(DecodeCompile("auto", calls={64: 200}))
    first = ledger.decide(**SHAPE)
    ledger.compiled((64, 80, 8), 0.1, signature="tiny", device="cpu")  # a record now exists: a new decision would differ
    assert ledger.decide(**SHAPE) is first and len(ledger.decisions) == 1


def test_prompt_widths_pad_to_the_runs_longest_rounded_to_the_bucket():
    assert [padded_width(w) for w in (1, 16, 17)] == [16, 16, 32]
    assert padded_width(5, 40) == 48 and padded_width(50, 40) == 64


@pytest.mark.parametrize("value", ["yes", "On", 1])
def test_bad_modes_are_refused_naming_the_option(value):
    with pytest.raises(ConfigError, match=r"decode_compile=.* is not a decode compile mode"):
        DecodeCompile.of(value)
    with pytest.raises(ConfigError, match=r"DecodeCompile.mode=.* is not a decode compile mode"):
        DecodeCompile(value)


@pytest.mark.parametrize("calls", [[64, 200], {64: -1}, {64: 2.5}])
def test_bad_projected_calls_are_refused(calls):
    with pytest.raises(ConfigError, match=r"DecodeCompile\(calls="):
        DecodeCompile("auto", calls=calls)


@pytest.mark.parametrize("width", [0, True, "48"])
def test_bad_widths_are_refused(width):
    with pytest.raises(ConfigError, match=r"DecodeCompile\(width="):
        DecodeCompile("auto", width=width)


JUNK = st.one_of(st.integers(-10**6, 10**6), st.floats(allow_nan=True, allow_infinity=True), st.none(), st.booleans(),
                 st.text(max_size=6), st.lists(st.integers(-2, 9), max_size=3))
KEYS = st.one_of(st.integers(-3, 99), st.text(max_size=3), st.booleans(), st.none(), st.floats(allow_nan=False))


@settings(max_examples=50, deadline=None)
@given(mode=st.one_of(JUNK, st.sampled_from(dc.MODES)), calls=st.one_of(JUNK, st.dictionaries(KEYS, JUNK, max_size=3)),
       width=JUNK)
def test_any_policy_is_built_or_refused_with_a_config_error(mode, calls, width):
    """Whatever a user passes, a policy is built (and then decides) or a ConfigError names the field."""
    try:
        policy = DecodeCompile(mode, calls=calls, width=width)
    except ConfigError as error:
        assert any(field in str(error) for field in ("DecodeCompile.mode=", "DecodeCompile(calls=", "DecodeCompile(width="))
        return
    assert policy.mode in dc.MODES and all(type(k) is int and type(v) is int and v >= 0 for k, v in policy.calls.items())
    assert isinstance(CompileLedger(DecodeCompile(policy.mode, calls=policy.calls)).decide(**SHAPE).compile, bool)


def test_the_executor_refuses_a_bad_mode_and_on_for_a_model_the_lean_step_cannot_drive(tokenizer):
    model = build_causal_lm(None, tokenizer=tokenizer)
    with pytest.raises(ConfigError, match=r"(?s)decode_compile=.sometimes. is not a decode compile mode.*fix: decode_compile: auto"):
        LocalExecutor({"policy": LMWorker(model)}, {}, tokenizer, decode_compile="sometimes")
    executor = LocalExecutor({"policy": LMWorker(model)}, {}, tokenizer, decode_compile="on")
    model.model.layers[0].register_forward_hook(lambda *args: None)  # what FSDP does: the lean step must not bypass it
    with pytest.raises(ConfigError, match="generation.compile=on compiles the lean decode step.*forward hooks"):
        executor.generate(executor.current("policy"), prompts_of(tokenizer, ["1+2="]), n=2)
    executor = LocalExecutor({"policy": LMWorker(model)}, {}, tokenizer, decode_compile="auto")
    decision = executor.decode_decision(model, 2, 4, 4)
    assert not decision.compile and "cannot drive this model (forward hooks" in decision.reason


def executor_of(model, tokenizer, mode, width=None):
    return LocalExecutor({"policy": LMWorker(model)}, {"reward": RewardWorker(lambda texts, **_: [0.0] * len(texts))},
                         tokenizer, max_new_tokens=5, seed=3, decode_compile=DecodeCompile(mode, width=width))


@pytest.mark.slow  # two Inductor compiles of the tiny model's decode step (cold, then from the disk cache): ~30 s
def test_compiled_decoding_in_the_executor_draws_the_eager_tokens_compiles_once_per_shape_and_reuses_the_disk_cache(
        tokenizer, cache_dir, monkeypatch):
    """Batches of other prompt widths (padded to the run's width), other seeds and updated weights reuse one graph;
    a second run (dynamo's in-memory graphs dropped) compiles the shape from Inductor's disk cache,
    and its auto rule reads the first run's measured compile. Float64 model: see
    tests/backends/test_generation_compiled.py for the 1e-5 on the log-probs."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(dc, "CHUNK_STEPS", 2)  # 5 tokens in 3 chunks (the last trimmed); a smaller graph to compile
    model = build_causal_lm(None, tokenizer=tokenizer, dtype=torch.float64).eval()
    batches = [prompts_of(tokenizer, texts) for texts in (["1+2=", "12+34="], ["99+9=", "5+55="], ["7+0=", "3+3="])]
    eager, compiled = executor_of(model, tokenizer, "off"), executor_of(model, tokenizer, "on", width=20)
    graphs = counters["stats"]["unique_graphs"]
    for prompts in batches:
        want = eager.generate(eager.current("policy"), prompts, n=3)
        got = compiled.generate(compiled.current("policy"), prompts, n=3)
        assert torch.equal(got.response_ids, want.response_ids) and torch.equal(got.mask, want.mask)
        assert torch.equal(got.prompt_ids, want.prompt_ids)  # the padding to the run's width stays inside the engine
        assert (got.logprobs - want.logprobs).abs().max() <= 1e-5
    with torch.no_grad():  # what an optimizer step does: new weights in the same tensors, read by the same graph
        for parameter in model.parameters():
            parameter.add_(0.5 * torch.randn_like(parameter))
    want = eager.generate(eager.current("policy"), batches[0], n=3)
    got = compiled.generate(compiled.current("policy"), batches[0], n=3)
    assert torch.equal(got.response_ids, want.response_ids) and (got.logprobs - want.logprobs).abs().max() <= 1e-5
    # 2 prompts x 3 samples over 32 + 3 x 2 columns: the prefill's graph and a chunk of 2 steps for four calls
    assert counters["stats"]["unique_graphs"] - graphs == 2
    assert compiled.decode_ledger.compiles == {(6, 38, 2): 1} and not eager.decode_ledger.compiles
    first = compiled.decode_ledger.pop_seconds()
    assert first > 0 and compiled.decode_ledger.pop_seconds() == 0.0
    assert any(cache_dir.rglob("*.py")), "Inductor wrote its compiled kernels to the run's cache directory"
    record = json.loads((cache_dir / dc.RECORD_FILE).read_text())
    assert list(record.values()) == [[round(first, 3)]]

    torch._dynamo.reset()  # a second run: no graph in memory, the same cache directory on disk
    hits = counters["inductor"]["fxgraph_cache_hit"]
    again = LocalExecutor({"policy": LMWorker(model)}, {}, tokenizer, max_new_tokens=5, seed=3,
                          decode_compile=DecodeCompile("auto", calls={6: 10**5}, width=20))
    decision = again.decode_decision(model, 6, 4, 5)
    assert decision.compile and f"compiled before in {cache_dir}: {min(record.values())[0]:.1f} s" in decision.reason
    got = again.generate(again.current("policy"), batches[0], n=3)
    assert counters["inductor"]["fxgraph_cache_hit"] > hits  # served from the disk cache, not compiled anew
    assert again.decode_ledger.compiles == {(6, 38, 2): 1}
    fresh = executor_of(model, tokenizer, "off")  # at the sampling stream's first call, as `again` is
    assert torch.equal(got.response_ids, fresh.generate(fresh.current("policy"), batches[0], n=3).response_ids)


# -- the compiled decode chunk (k steps and their sampling a call) and the compiled prefill ----------------------------

def test_a_chunk_is_taken_for_temperature_and_greedy_sampling_and_not_for_a_nucleus_or_a_large_noise(tokenizer,
                                                                                                    monkeypatch):
    """No compile here: which decode path a call takes. A nucleus needs a sort per row (the per-step sampler);
    the chunk's noise [N, k, V] is precomputed, so a call whose noise passes the budget runs a call a step."""
    from rlgraph.backends.local import generation
    from rlgraph.backends.local.generation import NativeGenerator
    from rlgraph.backends.local.counter_sampling import SamplingParams

    model = build_causal_lm(None, tokenizer=tokenizer)
    ids = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    chunked = NativeGenerator(model, **ids, compile_decode=True)
    assert chunked._chunk(8, SamplingParams(max_new_tokens=16)) == dc.CHUNK_STEPS
    assert chunked._chunk(8, SamplingParams(temperature=0.0, max_new_tokens=16)) == dc.CHUNK_STEPS
    assert chunked._chunk(8, SamplingParams(max_new_tokens=3)) == 3  # a shorter call: one chunk of its steps
    assert chunked._chunk(8, SamplingParams(top_p=0.9, max_new_tokens=16)) is None
    vocab = model.get_input_embeddings().num_embeddings
    monkeypatch.setattr(generation, "CHUNK_NOISE_WORDS", 8 * dc.CHUNK_STEPS * vocab)
    assert chunked._chunk(8, SamplingParams()) == dc.CHUNK_STEPS and chunked._chunk(9, SamplingParams()) is None
    assert NativeGenerator(model, **ids, compile_decode=True, chunked=False)._chunk(8, SamplingParams()) is None
    assert NativeGenerator(model, **ids)._chunk(8, SamplingParams()) is None  # eager: no chunk


@pytest.mark.parametrize("chunked", [None, 1, "yes"])
def test_a_chunked_flag_that_is_no_bool_is_refused(tokenizer, chunked):
    from rlgraph.backends.local.generation import NativeGenerator

    with pytest.raises(ValueError, match=r"NativeGenerator\(chunked=.*\) must be True or False"):
        NativeGenerator(build_causal_lm(None, tokenizer=tokenizer), eos_token_id=2, pad_token_id=0, compile_decode=True,
                        chunked=chunked)


def test_chunk_compiles_are_recorded_under_rows_length_and_k(cache_dir):
    """A chunk's compile (with its prefill) is its own record: a step's record of the same rows and
    cache length says nothing about it, and `auto` reads the chunk's."""
    ledger = CompileLedger(DecodeCompile("on"))
    ledger.compiled((64, 80), 0.5, signature="tiny", device="cpu")
    ledger.compiled((64, 80, 8), 2.5, signature="tiny", device="cpu")
    assert json.loads((cache_dir / dc.RECORD_FILE).read_text()) == {"tiny|cpu|64x80": [0.5], "tiny|cpu|64x80x8": [2.5]}
    warm = CompileLedger(DecodeCompile("auto", calls={64: 10**4})).decide(**SHAPE)
    assert warm.compile and "2.5 s" in warm.reason


def biased_model64(tokenizer, bias: float):
    """The tiny model in float64 with an EOS bias on its LM head (rows stop at different steps)."""
    model = build_causal_lm(None, tokenizer=tokenizer, dtype=torch.float64).eval()
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True, dtype=torch.float64)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[tokenizer.eos_token_id] = bias
    model.lm_head = head
    return model


@pytest.mark.slow  # three Inductor compiles of the tiny model (prefill, a chunk of 4 steps, a step): 1-3 min
def test_the_compiled_chunk_draws_the_tokens_of_the_eager_loop_and_of_the_compiled_step(tokenizer, monkeypatch):
    """5 tokens in chunks of k = 2 (the third chunk runs whole and is trimmed), rows that stop at
    different steps inside a chunk, temperature 1 and 0.7 and greedy, two seeds (and top-p 0.9, which
    takes the compiled step instead of a chunk): the eager loop's
    and the per-step compiled loop's tokens and masks, log-probs within 1e-5 (float64 model:
    tests/backends/test_generation_compiled.py derives it). One graph for the chunk and one for the
    prefill serve every call; a call whose rows all stop in the first chunk runs no second chunk."""
    from torch._dynamo.utils import counters

    from rlgraph.backends.local import lean_decode
    from rlgraph.backends.local.generation import NativeGenerator
    from rlgraph.backends.local.counter_sampling import SamplingParams

    monkeypatch.setattr(dc, "CHUNK_STEPS", 2)  # k = 8 compiles 4x longer and tests nothing more
    model = biased_model64(tokenizer, 2.0)
    ids = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    prompts = prompts_of(tokenizer, ["1+2=", "12+34=", "99+9=", "5+55="])
    eager = NativeGenerator(model, **ids)
    stepwise = NativeGenerator(model, **ids, compile_decode=True, chunked=False)
    chunked = NativeGenerator(model, **ids, compile_decode=True)
    graphs, lengths = None, []
    for params in (SamplingParams(temperature=1.0, max_new_tokens=5), SamplingParams(temperature=0.7, max_new_tokens=5),
                   SamplingParams(temperature=0.0, max_new_tokens=5),
                   SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=5)):  # a nucleus: the compiled step
        for seed in (3, 4):
            want = eager.generate(prompts, 2, params, seed=seed)
            got = chunked.generate(prompts, 2, params, seed=seed)
            graphs = counters["stats"]["unique_graphs"] if graphs is None else graphs
            step = stepwise.generate(prompts, 2, params, seed=seed)
            for other in (want, step):
                assert torch.equal(got.response_ids, other.response_ids) and torch.equal(got.mask, other.mask)
                assert (got.logprobs - other.logprobs).abs().max() <= 1e-5
            lengths.append(got.mask.sum(1))  # [N]
    assert any(0 < int(length.min()) < int(length.max()) for length in lengths)  # rows stopped at different steps
    # the chunk's shape (16 + 3 x 2 columns, k = 2) and the nucleus call's step (16 + 5 columns)
    assert chunked.ledger.compiles == {(8, 16 + 6, 2): 1, (8, 16 + 5): 1} and chunked.compile_seconds > 0
    calls = []
    real = lean_decode.LeanDecoder.compiled_chunk
    monkeypatch.setattr(lean_decode.LeanDecoder, "compiled_chunk", lambda self, *args: calls.append(1) or real(self, *args))
    with torch.no_grad():
        model.lm_head.bias[tokenizer.eos_token_id] = 1e4  # every row ends at its first token
    got = chunked.generate(prompts, 2, SamplingParams(max_new_tokens=5), seed=3)
    assert got.response_ids.shape == (8, 1) and (got.response_ids == tokenizer.eos_token_id).all() and len(calls) == 1
    assert counters["stats"]["unique_graphs"] - graphs == 1  # after the chunk's first call: the step's graph alone


@pytest.mark.slow  # the graphs of the test above (the same shapes), compiled again when this test runs alone
def test_the_compiled_chunk_draws_the_eager_tokens_for_any_prompts_seed_and_temperature(tokenizer, monkeypatch):
    """Hypothesis over prompt texts (4 prompts of 1-9 characters: one 16-column bucket, so one graph),
    seeds, calls and temperatures, on the EOS-biased float64 model: the eager loop's rollouts."""
    from rlgraph.backends.local.generation import NativeGenerator
    from rlgraph.backends.local.counter_sampling import SamplingParams

    monkeypatch.setattr(dc, "CHUNK_STEPS", 2)
    model = biased_model64(tokenizer, 2.0)
    ids = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    eager, chunked = NativeGenerator(model, **ids), NativeGenerator(model, **ids, compile_decode=True)

    @settings(max_examples=12, deadline=None)
    @given(texts=st.lists(st.text(alphabet="0123456789+=", min_size=1, max_size=9), min_size=4, max_size=4),
           seed=st.integers(0, 2**40), call=st.integers(0, 99), temperature=st.sampled_from([1.0, 0.7, 0.0]))
    def draws_the_eager_rollouts(texts, seed, call, temperature):
        prompts, params = prompts_of(tokenizer, texts), SamplingParams(temperature=temperature, max_new_tokens=5)
        want = eager.generate(prompts, 2, params, seed=seed, call=call)
        got = chunked.generate(prompts, 2, params, seed=seed, call=call)
        assert torch.equal(got.response_ids, want.response_ids) and torch.equal(got.mask, want.mask)
        assert (got.logprobs - want.logprobs).abs().max() <= 1e-5

    draws_the_eager_rollouts()
    assert len(chunked.ledger.compiles) == 1  # every example one (rows, cache length, k) shape


@pytest.mark.slow  # an Inductor compile of the tiny model's prefill: ~10-60 s on 2 cores
def test_the_compiled_prefill_gives_the_eager_logits_and_cache(tokenizer):
    """float32, 2 prompts x 3 samples of 16 columns (left-padded). Inductor reorders the float32 sums;
    a reordered sum of K terms moves by at most K u sum|terms| (u = 2**-24). The longest sum is the MLP's
    down projection, K = 256; the logits pass through 2 layers and the head, each a sum of at most
    K products over activations that RMS norm keeps near 1, and the residual adds; bound each of the
    5 reductions on the path by K u max|logits| and add them: 5 x 256 x 2**-24 x max|logits| (about
    1e-3 here, where a wrong column or position moves the logits by 1e-2 and more: test_lean_static)."""
    from rlgraph.backends.local.lean_decode import LeanDecoder

    model = build_causal_lm(None, tokenizer=tokenizer).eval()
    prompts = prompts_of(tokenizer, ["1+2=", "12+345="])
    ids, mask = dc_pad(prompts, tokenizer)
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        eager, compiled = LeanDecoder(model), LeanDecoder(model)
        want = eager.start(ids, mask, positions, 5, 3)  # [6, V]
        got = compiled.start(ids, mask, positions, 5, 3, compiled=True)  # [6, V]
    bound = 5 * 256 * 2**-24 * want.abs().max()
    assert got.shape == want.shape == (6, model.config.vocab_size) and (got - want).abs().max() <= bound
    assert torch.equal(compiled.key_mask, eager.key_mask)
    for (keys, values), (keys_want, values_want) in zip(compiled.cache, eager.cache):
        assert (keys - keys_want).abs().max() <= bound and (values - values_want).abs().max() <= bound
        assert keys[:, :, 16:].count_nonzero() == 0  # the columns not yet written are zeros


def dc_pad(prompts, tokenizer):
    from rlgraph.backends.local.generation import pad_prompt_columns

    return pad_prompt_columns(prompts.ids, prompts.mask.bool(), padded_width(prompts.ids.shape[1]),
                              tokenizer.pad_token_id)
