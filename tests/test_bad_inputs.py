"""Malformed inputs of every family (issue 12) get a clear `RLGraphError`, never a raw error, a hang
or a non-finite weight. The project's own version of the probe that found them.

Documented acceptances: a drawn value that happens to be valid (e.g. gamma=0.5) runs; argparse's own
usage errors exit with status 2 (SystemExit), as every command line does.
"""

import math
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rlgraph as rg
from rlgraph.algorithms import ALGORITHMS
from rlgraph.algorithms.hparams import RULES
from rlgraph.backends.local.executor import RewardWorker
from rlgraph.backends.local.generation import NativeGenerator
from rlgraph.backends.local.counter_sampling import SamplingParams
from rlgraph.backends.protocols import ModelRef, RewardRef
from rlgraph.batches import BatchError, Prompts, Rollouts
from rlgraph.cli import main
from rlgraph.errors import ConfigError, RLGraphError, SpecError, TraceError
from rlgraph.train.checkpoint import latest_checkpoint, save_checkpoint
from rlgraph.testing import tiny_executor, tiny_prompts

# values a new user types by mistake: wrong sign, NaN/inf, huge, zero, text, None, bools, containers
JUNK = st.one_of(st.integers(-10**9, 10**9), st.floats(allow_nan=True, allow_infinity=True), st.none(), st.booleans(),
                 st.text(max_size=6), st.lists(st.integers(-2, 9), max_size=3))


def accepted_or_clear(call) -> bool:
    """Run `call`; True if it ran, False if it raised an RLGraphError; any other error fails the test."""
    try:
        call()
    except RLGraphError as exc:
        assert str(exc).strip(), "an RLGraphError must say something"
        return False
    return True


@given(algorithm=st.sampled_from(sorted(ALGORITHMS)), value=JUNK, data=st.data())
def test_hyper_parameters(algorithm, value, data):
    params = [p for p in ALGORITHMS[algorithm].fn.__code__.co_varnames if p in RULES]
    if not params:
        return
    name = data.draw(st.sampled_from(params))
    accepted_or_clear(lambda: ALGORITHMS[algorithm].trace(**{name: value}))


SIZES = st.dictionaries(st.sampled_from(["B", "P", "T", "n", "X"]), JUNK, max_size=4) | st.fixed_dictionaries(
    {"B": JUNK, "P": st.integers(1, 8), "T": st.integers(1, 8)})
MESHES = st.one_of(JUNK, st.sampled_from(["gpu:8", "cpu:2", "h100:0", "8", "2x8:h100", "tpu:4", "gpu:-1", ":"]))
GROUP_NAMES = st.sampled_from(["policy", "rollout", "rolout", "ref", "critic", "actor"])
RANKS = st.one_of(st.integers(-1, 9), st.lists(st.integers(-1, 9), max_size=4), st.sampled_from(["policy", "rollout"]))
PLACEMENTS = st.one_of(
    st.builds(lambda fsdp, tp: rg.colocated(fsdp=fsdp, tp=tp), st.one_of(st.none(), st.integers(-2, 9)), st.integers(-1, 9)),
    st.builds(rg.split, st.dictionaries(GROUP_NAMES, RANKS, min_size=1, max_size=3)),
    st.builds(lambda value: rg.colocated(cpu_offload=value), JUNK),
    st.builds(lambda value: rg.split({"policy": 4, "rollout": 4}, cpu_offload=value), JUNK),
)


OPTIONS = {"mesh": MESHES, "sizes": SIZES, "placement": PLACEMENTS,
           "models": st.dictionaries(st.sampled_from(["policy", "polcy", "ref", "actor"]), st.just("tiny-qwen2"), max_size=2)}


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(bad=st.sampled_from(sorted(OPTIONS)), data=st.data())
def test_compile_options(bad, data):
    # one drawn option among valid ones, so each check is reached rather than masked by an earlier one
    options = dict(mesh="gpu:8", sizes={"B": 8, "P": 8, "T": 4}, placement=rg.colocated(), models={})
    options[bad] = data.draw(OPTIONS[bad], label=bad)
    accepted_or_clear(lambda: rg.compile(ALGORITHMS["grpo"], n=2, **options))


FLAG_VALUES = st.text(alphabet="BPTn=,0123456789.-abx:h", max_size=12)


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(flag=st.sampled_from(["--sizes", "--mesh", "--placement", "-p"]), value=FLAG_VALUES)
def test_command_lines(flag, value):
    try:
        code = main(["plan", "grpo", flag, value])
    except SystemExit as exit:  # argparse's usage errors and the CLI's own exits: a message, never a traceback
        assert exit.code not in (0, None)
        return
    assert code in (0, 1)


@pytest.fixture(scope="module")
def executor():
    return tiny_executor()


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=15)
@given(ids=st.lists(st.lists(st.one_of(st.integers(-5, 10**6), st.floats(-1, 1e6)), min_size=1, max_size=3),
                    min_size=1, max_size=2).filter(lambda rows: len({len(row) for row in rows}) == 1))
def test_prompt_ids(executor, ids):
    tensor = torch.tensor(ids)
    prompts = Prompts(tensor, torch.ones(tensor.shape, dtype=torch.bool), {})
    generator = NativeGenerator(executor.models["policy"].model, eos_token_id=executor.tokenizer.eos_token_id,
                                pad_token_id=executor.tokenizer.pad_token_id)
    accepted_or_clear(lambda: generator.generate(prompts, 1, SamplingParams(max_new_tokens=2)))


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=15)
@given(values=st.lists(JUNK, min_size=0, max_size=5))
def test_reward_outputs(executor, values):
    executor.rewards["reward"] = RewardWorker(lambda completions, **meta: values)
    rollouts = executor.generate(ModelRef("policy", 0), tiny_prompts(2), n=2)
    if accepted_or_clear(lambda: executor.score(RewardRef("reward"), rollouts)):
        assert len(values) == 4 and all(math.isfinite(float(v)) for v in values)  # accepted only when well-formed
    assert all(torch.isfinite(p).all() for p in executor.models["policy"].model.parameters())


# -- issue 19: the Python API, tried as a new user would -------------------------------------------


def _traced(body):
    @rg.algorithm
    def algo(state: rg.State, prompts: rg.Prompts):
        return body(state, prompts)

    return algo


@pytest.mark.parametrize("call, prim", [
    (lambda s, p: rg.score(s.reward, p), "score"),
    (lambda s, p: rg.logprobs(s.policy, p), "logprobs"),
    (lambda s, p: rg.update(s.policy, p, lambda lp: lp.mean()), "update"),
])
def test_a_primitive_given_prompts_says_what_it_expects_and_what_to_call(call, prim):
    with pytest.raises(SpecError) as exc:
        _traced(lambda s, p: (s, {"x": call(s, p)}) if prim != "update" else call(s, p)).trace()
    text = str(exc.value)
    assert f"rg.{prim}:" in text and "must be Rollouts[N,T]" in text and "got Prompts[B,P]" in text
    assert "rg.generate(state.policy, prompts" in text.split("fix:")[1] and "test_bad_inputs.py:" in text


def test_an_algorithm_called_on_data_names_rg_compile():
    grpo = ALGORITHMS["grpo"]
    for state in (None, {}, object()):  # what a new user passes as the state
        with pytest.raises(TraceError) as exc:
            grpo(state, tiny_prompts(2))
        assert "grpo is an @rg.algorithm" in str(exc.value) and "rg.compile(grpo" in str(exc.value)
        assert "Prompts" in exc.value.summary and "test_bad_inputs.py:" in str(exc.value)


def test_an_algorithm_over_prompts_inlined_on_rollouts_names_both():
    @rg.algorithm
    def on_rollouts(state: rg.State, ro: rg.Rollouts):
        return ALGORITHMS["grpo"](state, ro)

    with pytest.raises(TraceError) as exc:
        on_rollouts.trace()
    assert "grpo takes Prompts as its batch (prompts), got Rollouts[N,T]" in exc.value.summary
    assert "ro: rg.Rollouts" in str(exc.value) and "test_bad_inputs.py:" in str(exc.value)


@pytest.mark.parametrize("value", [0, -3, 2.5, "8", True])
def test_generate_max_new_tokens_must_be_a_positive_int(value):
    with pytest.raises(TraceError, match=rf"rg.generate: max_new_tokens={value!r} is not valid; it must be a whole number >= 1"):
        _traced(lambda s, p: (s, {"x": rg.score(s.reward, rg.generate(s.policy, p, max_new_tokens=value))})).trace()
    with pytest.raises(TraceError, match="max_new_tokens"):  # through an algorithm's hyper-parameter too
        ALGORITHMS["grpo"].trace(max_new_tokens=value)


@pytest.mark.parametrize("value", [0, -1, "many"])
def test_config_max_new_tokens_is_refused_by_key(value):
    from rlgraph.train.config import load_config

    for key in ("rollout.max_new_tokens", "eval.max_new_tokens"):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(None, [f"{key}={value}"])


@pytest.mark.parametrize("fn", ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm",
                                "masked_mean", "masked_sum", "masked_whiten"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_a_float_mask_is_refused_naming_the_function_and_dtype(fn, dtype):
    loss, mask = torch.randn(3, 4), torch.tensor([[1.0, 0.5, 0.0, 0.0]] * 3, dtype=dtype)  # 0.5: a weight, not a mask
    with pytest.raises(SpecError) as exc:
        getattr(rg.functional, fn)(loss, mask)
    assert f"F.{fn}: mask is a {dtype} tensor" in exc.value.summary and "test_bad_inputs.py:" in str(exc.value)
    # integer 0/1 masks (HF attention masks) are read as != 0: the same numbers as the bool mask
    torch.testing.assert_close(getattr(rg.functional, fn)(loss, (mask > 0).long()), getattr(rg.functional, fn)(loss, mask > 0))


def test_a_float_mask_is_refused_at_trace_time_at_the_line():
    def body(state, prompts):
        ro = rg.generate(state.policy, prompts, n=2)
        return state, {"x": rg.functional.token_mean(ro.logprobs, ro.logprobs)}  # E-float-mask

    with pytest.raises(SpecError) as exc:
        _traced(body).trace()
    assert "F.token_mean: mask is a torch.float32 tensor" in str(exc.value) and "E-float-mask" in str(exc.value)


@pytest.mark.parametrize("args, kwargs, words", [
    ((8,), {}, "first argument is the device kind"), ((None,), {}, "first argument is the device kind"),
    (("h100", "2", 8), {}, "nodes must be a whole number >= 1, got '2'"),
    (("h100", 1, 8.0), {}, "per_node must be a whole number >= 1, got 8.0"),
    (("h100", True, 8), {}, "nodes must be a whole number >= 1, got True"),
    (("h100", 0, 8), {}, "must be >= 1, got 0x8"), (("h100", 1, -8), {}, "must be >= 1, got 1x-8"),
    (("tpu", 1, 8), {}, "unknown device 'tpu'"),
    (("h100", 1, 8), {"memory_gib": -80}, "memory_gib must be a number of GiB > 0"),
    (("h100", 1, 8), {"memory_gib": "80"}, "memory_gib must be a number of GiB > 0"),
])
def test_mesh_arguments(args, kwargs, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        rg.Mesh(*args, **kwargs)
    assert rg.Mesh("h100", 2, 8).size == 16


def _rollouts(**changes):
    fields = dict(prompt_ids=torch.ones(2, 3, dtype=torch.long), prompt_mask=torch.ones(2, 3, dtype=torch.bool),
                  response_ids=torch.ones(2, 4, dtype=torch.long), mask=torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]]).bool(),
                  logprobs=torch.full((2, 4), -0.5), group=torch.tensor([0, 0]))
    return Rollouts(**{**fields, **changes})


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_old_logprobs_at_real_tokens_are_refused_by_sample(bad):
    logprobs = torch.full((2, 4), -0.5)
    logprobs[0, 3] = bad  # padding (mask False): anything is fine
    _rollouts(logprobs=logprobs)
    logprobs[1, 2] = bad  # a real token of sample 1
    with pytest.raises(BatchError, match=rf"Rollouts.logprobs is {bad} at sample 1, token 2, a real token"):
        _rollouts(logprobs=logprobs)


@pytest.mark.parametrize("group, words", [(torch.tensor([0, -1]), "negative id -1 at sample 1"),
                                          (torch.tensor([0.0, 1.0]), "must be i64[N]"),
                                          (torch.tensor([True, False]), "must be i64[N]")])
def test_bad_group_ids_are_refused_by_sample(group, words):
    with pytest.raises(BatchError, match=re.escape(words)):
        _rollouts(group=group)


def test_a_float_rollouts_mask_is_refused():
    with pytest.raises(BatchError, match="Rollouts.mask is torch.float32; masks are bool"):
        _rollouts(mask=torch.ones(2, 4))


@pytest.mark.parametrize("field, bad", [("response_ids", -1), ("response_ids", 10**6), ("prompt_ids", 10**6)])
@pytest.mark.parametrize("primitive", ["logprobs", "update"])
def test_out_of_vocabulary_ids_given_to_the_runtime_name_the_sample(executor, field, bad, primitive):
    from rlgraph.backends.protocols import UpdateConfig

    ids = getattr(_rollouts(), field).clone()
    ids[1, 1] = bad
    rollouts = _rollouts(**{field: ids})
    vocab = executor.models["policy"].model.get_input_embeddings().num_embeddings
    call = {"logprobs": lambda: executor.logprobs(ModelRef("policy", executor.models["policy"].version), rollouts),
            "update": lambda: executor.update(ModelRef("policy", executor.models["policy"].version), rollouts,
                                              lambda lp: lp.mean(), UpdateConfig())}[primitive]
    with pytest.raises(BatchError, match=rf"rg.{primitive}\(policy\): Rollouts.{field} of sample 1 holds token ids "
                                         rf"\[{bad}\] outside the model's vocabulary 0..{vocab - 1}"):
        call()


@pytest.mark.parametrize("garbage", [b"\x00\xff not json", b'{"path": "../../etc"}', b'{"path": "step-000009"}', b"[1, 2]"])
def test_a_garbage_latest_file_falls_back_to_the_newest_complete_checkpoint(tmp_path, garbage):
    (tmp_path / "latest").write_bytes(garbage)
    with pytest.raises(ConfigError, match="holds no complete step-\\* checkpoint to fall back on") as exc:
        latest_checkpoint(tmp_path)
    assert f"delete {tmp_path / 'latest'}" in str(exc.value)
    for step in (2, 3):
        save_checkpoint(tmp_path, step, tiny_executor(), {})
    (tmp_path / "step-000004").mkdir()  # an incomplete leftover: no meta.json
    (tmp_path / "latest").write_bytes(garbage)
    with pytest.warns(UserWarning, match="using the newest complete checkpoint step-000003 instead"):
        assert latest_checkpoint(tmp_path) == tmp_path / "step-000003"


@pytest.mark.parametrize("batch", ["rollouts", None, "ids"])
def test_running_a_program_on_the_wrong_batch_names_both(executor, batch):
    from rlgraph.runtime.eager import Interpreter

    prompts = tiny_prompts(2)
    rollouts = executor.generate(ModelRef("policy", executor.models["policy"].version), prompts, n=2)
    given = {"rollouts": rollouts, None: None, "ids": prompts.ids}[batch]
    with pytest.raises(BatchError, match=f"grpo takes Prompts as its batch, got {type(given).__name__}") as exc:
        Interpreter(executor).run(ALGORITHMS["grpo"].trace(n=2, max_new_tokens=2), given)
    assert "rg.Rollouts" in str(exc.value).split("fix:")[1]
    with pytest.raises(BatchError, match="sft takes Rollouts as its batch, got Prompts"):
        Interpreter(executor).run(ALGORITHMS["sft"].trace(), prompts)


@pytest.mark.parametrize("mask", [[[True, False]], None, 1.0])
def test_a_mask_that_is_not_a_tensor_is_refused(mask):
    with pytest.raises(SpecError, match=f"F.token_mean: mask must be a bool tensor, got {type(mask).__name__}"):
        rg.functional.token_mean(torch.ones(1, 2), mask)


@pytest.mark.parametrize("value", [-1, 1001, "many"])
def test_config_logging_samples_is_refused_by_key(value):
    from rlgraph.train.config import load_config

    with pytest.raises(ConfigError, match=r"logging\.samples"):
        load_config(None, [f"logging.samples={value}"])
