"""The `pack` pass and `rg.compile(micro_batch_tokens=)`: the budget reaches every model forward,
the plan prints packed micro-batches and counts their tokens' memory, and the compiled packed run
gives the eager padded run's numbers."""

import pytest

import rlgraph as rg
import rlgraph.testing as rgt
from rlgraph.algorithms import grpo, ppo
from rlgraph.errors import ConfigError
from rlgraph.ir.primitives import primitive_name
from rlgraph.plan import memory as M
from rlgraph.plan.model_size import ModelShape
from rlgraph.plan.presets import load_model_config
from tests.helpers import prompts

SIZES = {"B": 4, "P": 8, "T": 4}


def _compile(algorithm=grpo, **options):
    return rg.compile(algorithm, mesh="cpu:1", placement=rg.colocated(offload=False, checkpointing=False),
                      sizes=SIZES, n=4, max_new_tokens=4, **options)


def test_the_budget_reaches_every_update_logprobs_and_values():
    compiled = _compile(ppo, micro_batch_tokens=24, kl=0.01)
    forwards = {primitive_name(node): node.kwargs.get("micro_batch_tokens") for node in compiled.program.graph.nodes
                if primitive_name(node) in ("update", "logprobs", "values")}
    assert forwards == {"update": 24, "logprobs": 24, "values": 24}
    # the traced source is left as it was (passes never edit their input)
    assert all("micro_batch_tokens" not in node.kwargs for node in compiled.source.graph.nodes)


def test_the_plan_prints_packed_micro_batches_with_their_tokens():
    text = _compile(micro_batch_tokens=24, kl=0.01).as_text()
    # 16 rows of P+T=12 tokens: a 24-token budget holds 2 full-length rows
    assert ("packed micro-batches of <= 24 tokens/rank, no padding (at full length P+T=12: 8 micro-batch(es) of "
            "2 rows = 24 tokens; shorter rows pack into fewer)") in text
    assert "forward only, 16 sequences/rank, packed in micro-batches of <= 24 tokens" in text
    assert "packed" not in _compile(kl=0.01).as_text()


@pytest.mark.parametrize("bad, message", [(0, "micro_batch_tokens=0 is not a whole number"),
                                          (-12, "micro_batch_tokens=-12 is not a whole number"),
                                          (12.5, "micro_batch_tokens=12.5 is not a whole number"),
                                          ("64", "micro_batch_tokens='64' is not a whole number"),
                                          (11, "micro_batch_tokens=11 is smaller than the longest row .* = 12")])
def test_a_bad_compile_budget_is_named(bad, message):
    with pytest.raises(ConfigError, match=message):
        _compile(micro_batch_tokens=bad)


def test_a_budget_beside_the_algorithms_micro_batch_size_is_refused():
    with pytest.raises(ConfigError, match="sets micro_batch_size=4; both would size its micro-batches"):
        _compile(micro_batch_tokens=24, micro_batch_size=4)


def test_a_budget_on_the_full_vocabulary_forwards_is_refused_at_compile_time():
    from rlgraph.algorithms import gkd

    roles = {"policy": rg.lm("policy"), "teacher": rg.lm("teacher")}
    with pytest.raises(ConfigError, match="logprobs .* takes vocab=True"):
        rg.compile(gkd, mesh="cpu:1", placement=rg.colocated(offload=False, checkpointing=False), sizes=SIZES, n=4,
                   max_new_tokens=4, micro_batch_tokens=24, vocab=True, roles=roles)


def test_an_updates_own_budget_below_a_full_row_is_refused_at_compile_time():
    @rg.algorithm
    def sft_packed(state: rg.State, batch: rg.Rollouts):
        policy = rg.update(state.policy, batch, lambda lp: -rg.functional.token_mean(lp, batch.mask), micro_batch_tokens=10)
        return state.replace(policy=policy), {}

    with pytest.raises(ConfigError, match="rg.update of update .*micro_batch_tokens=10 is smaller than the longest row"):
        rg.compile(sft_packed, mesh="cpu:1", sizes=SIZES)


def test_packed_train_memory_counts_tokens_and_the_mask():
    """The formula: train_memory at the budget's tokens, seq_len = the budget, plus the bool and
    additive [L, L] masks; at the same tokens it exceeds the padded figure by exactly the mask."""
    shape = ModelShape.from_hf_config(load_model_config("qwen2.5-0.5b"))
    config = M.TrainMemoryConfig(micro_batch_tokens=4096, seq_len=1024, checkpointing=False)
    packed, padded = M.packed_train_memory(shape, config), M.train_memory(shape, config)
    assert M.packed_mask_bytes(4096, config.param_dtype) == 4096 * 4096 * (1 + 2)  # bf16
    assert packed.activations - padded.activations == M.packed_mask_bytes(4096, config.param_dtype)
    assert attrs_except(packed, "activations") == attrs_except(padded, "activations")
    # materialised scores see the whole micro-batch as keys
    eager = attrs_evolve(config, fused_attention=False)
    assert M.packed_train_memory(shape, eager).activations == (
        M.train_memory(shape, attrs_evolve(eager, seq_len=4096)).activations + M.packed_mask_bytes(4096, config.param_dtype))


def test_the_memory_plan_counts_the_packed_tokens_not_rows_times_the_longest():
    """16 rows x 12 tokens padded = 192 tokens a micro-batch; packed at 24 tokens: 24 tokens + mask."""
    shape = ModelShape.from_hf_config(load_model_config("tiny-qwen2"))
    padded, packed = _compile(kl=0.01), _compile(micro_batch_tokens=24, kl=0.01)
    base = M.TrainMemoryConfig.for_device("cpu", checkpointing=False, seq_len=12)
    assert padded.plan.memory["policy"]["train"] == M.train_memory(shape, attrs_evolve(base, micro_batch_tokens=192)).as_dict()
    assert packed.plan.memory["policy"]["train"] == M.packed_train_memory(shape, attrs_evolve(base, micro_batch_tokens=24)).as_dict()
    assert packed.plan.memory["policy"]["train"]["activations"] < padded.plan.memory["policy"]["train"]["activations"]


@pytest.mark.parametrize("budget", [12, 40])
def test_the_compiled_packed_plan_gives_the_eager_padded_numbers(budget):
    """GRPO's first steps: the plan runner with packed micro-batches (and packed reference
    log-probs) against the eager interpreter's padded whole-batch forwards. The forwards differ in
    summation order only (tests/backends/test_packing.py derives the tolerance)."""
    rgt.assert_compiled_matches_eager(grpo, executor=lambda: rgt.tiny_executor(("policy", "ref")),
                                      batches=[prompts(4, offset=4 * i) for i in range(2)], sizes=SIZES, n=4,
                                      max_new_tokens=4, kl=0.01, micro_batch_tokens=budget, rtol=1e-4, atol=1e-5)


def test_the_compiled_packed_ppo_plan_gives_the_eager_padded_numbers():
    """PPO: the critic's values and its update are packed too (the critic's own forward)."""
    rgt.assert_compiled_matches_eager(ppo, executor=lambda: rgt.tiny_executor(("policy", "critic", "ref")),
                                      batches=[prompts(4, offset=4 * i) for i in range(2)], sizes=SIZES, n=4,
                                      max_new_tokens=4, kl=0.01, micro_batch_tokens=24, rtol=1e-4, atol=1e-5)


def attrs_evolve(value, **changes):
    import attrs

    return attrs.evolve(value, **changes)


def attrs_except(value, name):
    import attrs

    return {key: item for key, item in attrs.asdict(value).items() if key != name}


def test_a_packed_plan_round_trips_through_json():
    from rlgraph.plan.plan import Plan

    plan = _compile(micro_batch_tokens=24, kl=0.01).plan
    again = Plan.from_json(plan.to_json())
    assert again == plan and "packed micro-batches of <= 24 tokens/rank" in again.as_text()
