"""Packed sequences (`rlgraph.backends.local.packing`): the packed forward and packed micro-batches
give the padded path's log-probs, loss, gradients and metrics, over random ragged lengths.

Tolerances: the packed and padded forwards run the same fp32 arithmetic on the same real tokens
in other shapes ([1, L] vs [n, P+T]), so only the summation order of the matmuls (contractions of
H=64 and I=256 terms, two layers) and of SDPA's softmax differs. fp32's unit roundoff is
u = 2^-24 ~ 6e-8; a reordered sum of K terms moves by at most ~K*u of its magnitude (~1.5e-5 at
K=256), so log-probs of magnitude <= ~5 agree within 1e-4 absolute (observed: ~5e-7). Gradients
are sums of <= 6 x 13 tokens' contributions of such values: rtol 1e-4 with an absolute floor of
1e-4 of the largest gradient entry (observed: ~1e-6 relative).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rlgraph as rg
from rlgraph import functional as F
from rlgraph.backends.local.logprobs import sequence_logprobs
from rlgraph.backends.local.models import build_causal_lm
from rlgraph.backends.local.packing import pack_rows, packed_attention_mask, row_tokens
from rlgraph.batches import Rollouts
from rlgraph.errors import ConfigError, TraceError
from rlgraph.runtime.eager import Interpreter
from rlgraph.testing.tiny import tiny_executor, tiny_prompts

VOCAB_LOW, VOCAB_HIGH = 4, 47  # the character tokenizer's ordinary ids (0-3 are special)


def ragged_rollouts(prompt_lengths: list[int], response_lengths: list[int], width: int, steps: int,
                    seed: int) -> Rollouts:
    """Rollouts with left-padded prompts and right-padded responses of the given lengths; random
    token ids and random sampling log-probs (the 'old' policy's) at the real response tokens."""
    g = torch.Generator().manual_seed(seed)
    rows = len(prompt_lengths)
    prompt_mask = torch.arange(width)[None] >= (width - torch.tensor(prompt_lengths))[:, None]  # [N, P]
    mask = torch.arange(steps)[None] < torch.tensor(response_lengths)[:, None]  # [N, T]
    prompt_ids = torch.randint(VOCAB_LOW, VOCAB_HIGH, (rows, width), generator=g).masked_fill(~prompt_mask, 0)
    response_ids = torch.randint(VOCAB_LOW, VOCAB_HIGH, (rows, steps), generator=g).masked_fill(~mask, 0)
    old = (-torch.rand(rows, steps, generator=g) * 4).masked_fill(~mask, 0.0)  # [N, T]
    return Rollouts(prompt_ids, prompt_mask, response_ids, mask, old, torch.arange(rows) // 2)


@st.composite
def ragged_batches(draw, max_rows: int = 6) -> Rollouts:
    rows = draw(st.integers(1, max_rows))
    width, steps = draw(st.integers(1, 6)), draw(st.integers(1, 7))
    prompt_lengths = draw(st.lists(st.integers(1, width), min_size=rows, max_size=rows))
    response_lengths = draw(st.lists(st.integers(0, steps), min_size=rows, max_size=rows))
    return ragged_rollouts(prompt_lengths, response_lengths, width, steps, draw(st.integers(0, 2**16)))


@pytest.fixture(scope="module")
def model():
    return build_causal_lm(seed=0).eval()


# -- the packed forward --------------------------------------------------------------------------


@settings(max_examples=20, deadline=None)
@given(batch=ragged_batches(), temperature=st.sampled_from([1.0, 0.7]))
def test_packed_logprobs_and_entropy_equal_the_padded_ones(model, batch, temperature):
    with torch.no_grad():
        padded, padded_entropy = sequence_logprobs(model, batch, temperature=temperature, with_entropy=True)
        packed, packed_entropy = sequence_logprobs(model, batch, temperature=temperature, with_entropy=True, packed=True)
    torch.testing.assert_close(packed, padded, rtol=0, atol=1e-4)
    torch.testing.assert_close(packed_entropy, padded_entropy, rtol=0, atol=1e-4)
    assert (packed[~batch.mask] == 0).all()


def test_eager_attention_takes_the_additive_mask_and_agrees():
    batch = ragged_rollouts([3, 1, 5], [4, 0, 2], 5, 4, seed=1)
    eager = build_causal_lm(seed=0, attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(sequence_logprobs(eager, batch, packed=True), sequence_logprobs(eager, batch),
                                   rtol=0, atol=1e-4)


def test_the_mask_is_causal_within_each_sequence_and_blind_across():
    mask = packed_attention_mask(torch.tensor([2, 1, 3]), "sdpa", torch.float32)[0, 0]
    expected = torch.tensor([[1, 0, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0, 0],
                             [0, 0, 1, 0, 0, 0],
                             [0, 0, 0, 1, 0, 0],
                             [0, 0, 0, 1, 1, 0],
                             [0, 0, 0, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(mask, expected)
    additive = packed_attention_mask(torch.tensor([2, 1, 3]), "eager", torch.float32)[0, 0]
    assert torch.equal(additive == 0, expected) and (additive[~expected] == torch.finfo(torch.float32).min).all()


def test_an_attention_without_a_packed_mask_is_refused_naming_it():
    with pytest.raises(ConfigError, match="'flash_attention_2'.*sdpa or eager"):
        packed_attention_mask(torch.tensor([2]), "flash_attention_2", torch.float32)


# -- packing rows into token budgets ------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=30), slack=st.integers(0, 60))
def test_every_row_lands_in_exactly_one_micro_batch_within_the_budget(lengths, slack):
    tokens = torch.tensor(lengths)
    budget = max(lengths) + slack
    rows = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(len(lengths)))
    micros = pack_rows(rows, tokens, budget, "test")
    assert sorted(torch.cat(micros).tolist()) == sorted(rows.tolist())
    assert all(int(tokens[micro].sum()) <= budget for micro in micros)
    # first fit never leaves two micro-batches that would fit in one
    sums = sorted(int(tokens[micro].sum()) for micro in micros)
    assert len(sums) < 2 or sums[0] + sums[1] > budget
    # within a micro-batch the rows keep their order in `rows`
    order = {row: i for i, row in enumerate(rows.tolist())}
    assert all([order[r] for r in micro.tolist()] == sorted(order[r] for r in micro.tolist()) for micro in micros)


@pytest.mark.parametrize("budget", [0, -5, 2.5, "64", True, None])
def test_a_bad_budget_is_named(budget):
    with pytest.raises(ConfigError, match=f"here: micro_batch_tokens={budget!r} is not a whole number"):
        pack_rows(torch.arange(2), torch.tensor([3, 4]), budget, "here")


def test_a_row_longer_than_the_budget_is_named_with_the_fix():
    with pytest.raises(ConfigError, match=r"(?s)rg.update\(policy\): row 2 has 9 tokens .* micro_batch_tokens=8.*"
                                          r"micro_batch_tokens >= 9"):
        pack_rows(torch.arange(3), torch.tensor([3, 4, 9]), 8, "rg.update(policy)")


# -- training: packed micro-batches == padded micro-batches --------------------------------------

AGGREGATIONS = {"token_mean": F.token_mean, "seq_mean_token_sum": F.seq_mean_token_sum,
                "seq_mean_token_mean": F.seq_mean_token_mean}


@rg.algorithm
def clipped_surrogate(state: rg.State, batch: rg.Rollouts, *, aggregate="token_mean", micro_batch_size=None,
                      micro_batch_tokens=None, minibatches=1):
    """A PPO-style loss on a fixed batch (advantage: the old log-prob's sign flipped per row)."""
    adv = torch.where(batch.group % 2 == 0, 1.0, -0.5)  # f32[N]

    def loss(lp):                                                        # lp: [N, T]
        ratio = torch.exp(lp - batch.logprobs)                           # [N, T]
        surr = torch.minimum(ratio * adv[:, None], ratio.clamp(0.8, 1.2) * adv[:, None])  # [N, T]
        return AGGREGATIONS[aggregate](-surr, batch.mask), {"lp": F.token_mean(lp, batch.mask)}

    policy = rg.update(state.policy, batch, loss, grad_clip=None, minibatches=minibatches,
                       micro_batch_size=micro_batch_size, micro_batch_tokens=micro_batch_tokens)
    return state.replace(policy=policy), {}


def _train(batch: Rollouts, **hparams) -> tuple[dict[str, float], list[torch.Tensor]]:
    """(metrics, gradients) of one update of a fresh tiny policy on `batch`."""
    executor = tiny_executor(lr=0.1)
    _, metrics = Interpreter(executor).run(clipped_surrogate.trace(**hparams), batch)
    return metrics, [p.grad.clone() for p in executor.models["policy"].model.parameters()]


def _assert_same_training(packed, padded) -> None:
    (packed_metrics, packed_grads), (padded_metrics, padded_grads) = packed, padded
    assert packed_metrics.keys() == padded_metrics.keys()
    for key, value in padded_metrics.items():
        assert packed_metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    scale = max(float(g.abs().max()) for g in padded_grads)
    for mine, theirs in zip(packed_grads, padded_grads):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4 * scale)


@settings(max_examples=12, deadline=None)
@given(batch=ragged_batches(), aggregate=st.sampled_from(sorted(AGGREGATIONS)), minibatches=st.integers(1, 2),
       slack=st.integers(0, 40), micro_batch_size=st.sampled_from([None, 1, 2]))
def test_packed_training_equals_padded_training(batch, aggregate, minibatches, slack, micro_batch_size):
    """Loss, gradients and metrics of packed token-budget micro-batches equal those of padded row
    micro-batches of any size: the aggregations divide by the whole mini-batch's counts."""
    budget = int(row_tokens(batch).max()) + slack
    packed = _train(batch, aggregate=aggregate, minibatches=minibatches, micro_batch_tokens=budget)
    padded = _train(batch, aggregate=aggregate, minibatches=minibatches, micro_batch_size=micro_batch_size)
    _assert_same_training(packed, padded)


def test_a_tight_budget_makes_several_micro_batches_and_changes_nothing():
    batch = ragged_rollouts([6, 2, 4, 1, 5, 3], [7, 1, 0, 5, 3, 7], 6, 7, seed=3)
    tokens = row_tokens(batch)  # [13, 3, 4, 6, 8, 10]
    assert len(pack_rows(torch.arange(6), tokens, 13, "t")) == 4
    _assert_same_training(_train(batch, micro_batch_tokens=13), _train(batch))


def test_a_lora_policy_packs_as_its_base_does():
    """peft wraps the model: the packed forward still finds the decoder, the attention
    implementation and the dtype through it (adapters trained a little, so they matter)."""
    from rlgraph.backends.lora import LoraSettings, apply_lora

    model = apply_lora(build_causal_lm(seed=0), LoraSettings(4, 8, 0.0, ("q_proj", "v_proj")), seed=0).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    batch = ragged_rollouts([3, 1, 5], [4, 0, 2], 5, 4, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(sequence_logprobs(model, batch, packed=True), sequence_logprobs(model, batch),
                                   rtol=0, atol=1e-4)


@rg.algorithm
def entropy_bonus(state: rg.State, batch: rg.Rollouts, *, micro_batch_tokens=None):
    """A loss that reads the entropy too (the forward's second output, packed alike)."""
    def loss(lp, entropy):                                               # [N, T], [N, T]
        return F.token_mean(-lp - 0.1 * entropy, batch.mask), {"entropy": F.token_mean(entropy, batch.mask)}

    policy = rg.update(state.policy, batch, loss, grad_clip=None, micro_batch_tokens=micro_batch_tokens)
    return state.replace(policy=policy), {}


def test_a_loss_with_the_entropy_trains_packed_as_padded():
    batch = ragged_rollouts([6, 2, 4, 1, 5, 3], [7, 1, 0, 5, 3, 7], 6, 7, seed=7)

    def train(**hparams):
        executor = tiny_executor(lr=0.1)
        metrics = Interpreter(executor).run(entropy_bonus.trace(**hparams), batch)[1]
        return metrics, [p.grad.clone() for p in executor.models["policy"].model.parameters()]

    _assert_same_training(train(micro_batch_tokens=14), train())


def test_packed_critic_values_equal_the_padded_ones():
    from rlgraph.backends.local.critic import build_critic

    critic = build_critic(seed=1).eval()
    batch = ragged_rollouts([3, 1, 5, 2], [4, 0, 2, 3], 5, 4, seed=4)
    with torch.no_grad():
        torch.testing.assert_close(critic.values(batch, packed=True), critic.values(batch), rtol=0, atol=1e-4)


def test_the_executors_packed_logprobs_equal_its_padded_ones():
    executor = tiny_executor()
    batch = ragged_rollouts([6, 2, 4, 1, 5, 3], [7, 1, 0, 5, 3, 7], 6, 7, seed=5)
    ref = executor.current("policy")
    padded, padded_entropy = executor.logprobs(ref, batch, entropy=True)
    packed, packed_entropy = executor.logprobs(ref, batch, entropy=True, micro_batch_tokens=14)
    torch.testing.assert_close(packed, padded, rtol=0, atol=1e-4)
    torch.testing.assert_close(packed_entropy, padded_entropy, rtol=0, atol=1e-4)
    with pytest.raises(ConfigError, match=r"rg.logprobs\(policy\): row 0 has 13 tokens"):
        executor.logprobs(ref, batch, micro_batch_tokens=12)


# -- rg.update(micro_batch_tokens=) --------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -64, 2.5, "64"])
def test_a_bad_micro_batch_tokens_is_named_at_the_users_line(bad):
    with pytest.raises(TraceError, match=f"rg.update: micro_batch_tokens={bad!r} is not valid"):
        clipped_surrogate.trace(micro_batch_tokens=bad)


def test_micro_batch_tokens_and_micro_batch_size_together_are_refused():
    with pytest.raises(TraceError, match="both size the micro-batches"):
        clipped_surrogate.trace(micro_batch_tokens=64, micro_batch_size=2)


def test_a_budget_below_the_longest_row_is_named_when_the_update_runs():
    batch = ragged_rollouts([6, 2], [7, 1], 6, 7, seed=6)
    with pytest.raises(ConfigError, match=r"rg.update\(policy\): row 0 has 13 tokens .* micro_batch_tokens=12"):
        _train(batch, micro_batch_tokens=12)


def test_the_update_prints_the_budget_only_when_set():
    def update_line(program) -> str:
        return next(line for line in str(program).splitlines() if "= update[" in line)

    assert "micro_batch_tokens=64" in update_line(clipped_surrogate.trace(micro_batch_tokens=64))
    assert "micro_batch_tokens" not in update_line(clipped_surrogate.trace())


# -- data-parallel ranks: as many micro-batches on every rank ------------------------------------


@pytest.mark.parametrize("extra", [1, 5])
def test_a_rank_that_needs_fewer_micro_batches_splits_and_fills_without_changing_the_step(monkeypatch, extra):
    """Under FSDP2 every rank runs as many packed micro-batches as the rank needing most (its
    forwards are collectives). Here the other ranks are pretended to need `extra` more: this rank
    splits its widest micro-batches, then (6 rows < 4 + 5) adds fillers whose backward adds 0."""
    from rlgraph.backends.local.executor import LocalExecutor

    batch = ragged_rollouts([6, 2, 4, 1, 5, 3], [7, 1, 0, 5, 3, 7], 6, 7, seed=3)
    padded = _train(batch)
    monkeypatch.setattr(LocalExecutor, "_all_reduce_max", lambda self, role, count: count + extra)
    seen: list[int] = []
    original = LocalExecutor._micro_batches

    def recording(self, *args, **kwargs):
        micros, real = original(self, *args, **kwargs)
        seen.append(len(micros) - real)
        return micros, real

    monkeypatch.setattr(LocalExecutor, "_micro_batches", recording)
    _assert_same_training(_train(batch, micro_batch_tokens=13), padded)
    assert seen == [max(0, 4 + extra - 6)]  # 4 micro-batches at 13 tokens; 6 rows can make 6


@pytest.mark.slow
@pytest.mark.parametrize("budget", [12, 24])
def test_packed_grpo_on_two_fsdp_ranks_matches_local(budget):
    """2 gloo ranks, FSDP2: each rank packs its 8 rows (their micro-batch counts agree through an
    all-reduce), with packed reference log-probs; the metrics and weights equal the local run's."""
    from rlgraph.backends.world import RoleSpec
    from tests.runtime.test_spmd import _compile, _matches_local, _world

    world = _world(policy=RoleSpec(optimizer="sgd", lr=0.1), ref=RoleSpec())
    _matches_local(_compile("grpo", n=4, kl=0.01, micro_batch_tokens=budget), world, tiny_prompts(4))
