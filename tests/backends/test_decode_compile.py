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
from rlgraph.backends.local.executor import LMWorker, LocalExecutor, RewardWorker
from rlgraph.backends.local.models import build_causal_lm
from rlgraph.ir.errors import ConfigError

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
    per_step = (dc.CPU_SAVING_PER_LAYER_S + dc.CPU_SAVING_PER_ROW_LAYER_S * 64) * 2  # 0.112 ms
    assert step_saving(64, 2, "cpu") == pytest.approx(per_step) and per_step > 0
    cold = dc.COLD_COMPILE_PER_LAYER_S * 2  # 14 s
    repaying = int(cold / (64 * per_step)) + 1  # the fewest calls whose saving passes the compile
    short, long = (CompileLedger(DecodeCompile("auto", calls={64: calls})).decide(**SHAPE)
                   for calls in (repaying - 1, repaying))
    assert not short.compile and long.compile
    assert f"{repaying} calls x 64 steps x {per_step * 1e3:.3f} ms" in long.reason and "> cold compile ~14 s" in long.reason
    assert "<= cold compile" in short.reason
    unprojected = CompileLedger(DecodeCompile("auto", calls={8: 10**6})).decide(**SHAPE)  # another number of rows
    assert not unprojected.compile and "0 calls" in unprojected.reason


def test_auto_reads_the_compile_measured_before_in_this_cache_directory(cache_dir):
    """A shape that compiled before in this cache directory compiles warm (Inductor serves it from
    disk): the recorded seconds, not the cold estimate, are what the saving must repay."""
    policy = DecodeCompile("auto", calls={64: 200})  # 200 x 64 x 0.112 ms = 1.4 s saved: short of a cold 14 s
    assert not CompileLedger(policy).decide(**SHAPE).compile
    ledger = CompileLedger(DecodeCompile("on"))
    ledger.compiled((64, 80), 0.5, signature="tiny", device="cpu")  # rows 64, cache 16 + 64 columns
    assert json.loads((cache_dir / dc.RECORD_FILE).read_text()) == {"tiny|cpu|64x80": [0.5]}
    warm = CompileLedger(policy).decide(**SHAPE)
    assert warm.compile and "compiled before" in warm.reason and "0.5 s" in warm.reason
    assert ledger.compiles == {(64, 80): 1} and ledger.pop_seconds() == 0.5 and ledger.pop_seconds() == 0.0


def test_auto_never_compiles_where_the_compiled_step_is_slower(cache_dir):
    """From ~90 rows on (2 layers, CPU) the compiled step is measured slower: no run is long enough."""
    assert step_saving(128, 2, "cpu") < 0
    decision = CompileLedger(DecodeCompile("auto", calls={128: 10**9})).decide(**{**SHAPE, "rows": 128})
    assert not decision.compile and "the compiled step is not faster" in decision.reason


def test_a_decision_is_made_once_per_shape(cache_dir):
    ledger = CompileLedger(DecodeCompile("auto", calls={64: 200}))
    first = ledger.decide(**SHAPE)
    ledger.compiled((64, 80), 0.1, signature="tiny", device="cpu")  # a record now exists: a new decision would differ
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
        tokenizer, cache_dir):
    """Batches of other prompt widths (padded to the run's width), other seeds and updated weights reuse one graph;
    a second run (dynamo's in-memory graphs dropped) compiles the shape from Inductor's disk cache,
    and its auto rule reads the first run's measured compile. Float64 model: see
    tests/backends/test_generation_compiled.py for the 1e-5 on the log-probs."""
    from torch._dynamo.utils import counters

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
    assert counters["stats"]["unique_graphs"] - graphs == 1  # 6 rows x (32 + 5) columns: one graph for four calls
    assert compiled.decode_ledger.compiles == {(6, 37): 1} and not eager.decode_ledger.compiles
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
    assert again.decode_ledger.compiles == {(6, 37): 1}
    fresh = executor_of(model, tokenizer, "off")  # at the sampling stream's first call, as `again` is
    assert torch.equal(got.response_ids, fresh.generate(fresh.current("policy"), batches[0], n=3).response_ids)
