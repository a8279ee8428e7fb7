"""Malformed inputs of every family (issue 12) get a clear `RLGraphError`, never a raw error, a hang
or a non-finite weight. The project's own version of the probe that found them.

Documented acceptances: a drawn value that happens to be valid (e.g. gamma=0.5) runs; argparse's own
usage errors exit with status 2 (SystemExit), as every command line does.
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rlgraph as rg
from rlgraph.algorithms import ALGORITHMS
from rlgraph.algorithms.hparams import RULES
from rlgraph.backends.local.executor import RewardWorker
from rlgraph.backends.local.generation import NativeGenerator, SamplingParams
from rlgraph.backends.protocols import ModelRef, RewardRef
from rlgraph.batches import Prompts
from rlgraph.cli import main
from rlgraph.ir.errors import RLGraphError
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
