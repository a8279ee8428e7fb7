"""The checkers catch the two classic bugs, and the counterexamples they print are minimal and run."""

import functools

import pytest
import torch
from hypothesis import settings

import rlgraph.testing as rgt
from rlgraph import functional as F
from rlgraph.testing import RolloutBatch, microbatch_losses

REPRODUCIBLE = settings(database=None, derandomize=True)


def per_micro_batch_mean_loss(b):
    """Broken on purpose: divides by its own micro-batch's token count, not the global one."""
    per_token = -b.advantages * torch.exp(b.logprobs - b.old_logprobs)
    return torch.where(b.mask, per_token, 0.0).sum() / b.mask.sum().clamp(min=1)


def padding_reading_estimator(b):
    """Broken on purpose: a log-prob bonus averaged over every position, padding included."""
    return F.group_normalize(b.rewards + b.logprobs.mean(-1), b.group)


@functools.cache
def failure_of(check, fn) -> rgt.PropertyFailure:
    """The failure `check` raises on `fn` (shrinking takes seconds: each case runs once per session)."""
    try:
        check(fn, settings=REPRODUCIBLE)
    except rgt.PropertyFailure as failure:
        return failure
    raise AssertionError(f"{check.__name__} did not catch {fn.__name__}")


def caught(check, fn) -> rgt.Counterexample:
    return failure_of(check, fn).counterexample


def run_snippet(counterexample, **names):
    namespace = dict(names)
    exec(counterexample.snippet(), namespace)  # the printed counterexample is valid Python
    return namespace


def test_a_loss_that_averages_per_micro_batch_is_caught_with_a_minimal_counterexample():
    found = caught(rgt.assert_microbatch_invariant, per_micro_batch_mean_loss)
    batch = found.batch
    # Minimal: two rows of one token each, every token real, one row per micro-batch.
    assert (batch.N, batch.T) == (2, 1)
    assert batch.mask.all()
    assert found.details["micro_batches"] == [[0], [1]]
    assert set(found.fields) == {"advantages", "logprobs", "old_logprobs", "mask"}
    # The snippet rebuilds the batch and shows the bug: parts sum to twice the full mean here.
    ns = run_snippet(found, per_micro_batch_mean_loss=per_micro_batch_mean_loss)
    full, parts = ns["full"], ns["parts"]
    assert not torch.isclose(sum(parts), full)
    assert torch.equal(ns["batch"].mask, batch.mask) and torch.equal(ns["batch"].advantages, batch.advantages)
    # The message names the property, the function and the numbers, then the snippet.
    text = str(failure_of(rgt.assert_microbatch_invariant, per_micro_batch_mean_loss))
    assert text.startswith("micro-batch invariance fails for per_micro_batch_mean_loss: out: sum over micro-batches")
    assert "paste into a test to reproduce:" in text and "RolloutBatch.of(" in text and "micro_batches = [[0], [1]]" in text


def test_the_correct_loss_passes_where_the_broken_one_fails():
    rgt.assert_microbatch_invariant(lambda b: F.ppo_clip(b.logprobs, b.old_logprobs, b.advantages, b.mask))


def test_an_estimator_that_reads_padding_is_caught_with_a_minimal_counterexample():
    found = caught(rgt.assert_padding_invariant, padding_reading_estimator)
    batch, padded = found.batch, found.details["padded"]
    # Minimal: one group, one token per row, every position padding; only padded values differ.
    assert batch.T == 1 and padded.T == 1 and found.details["extra_columns"] == 0
    assert batch.group.unique().numel() == 1 and batch.N <= 3
    assert not batch.mask.any()
    assert not torch.equal(batch.logprobs, padded.logprobs)
    assert torch.equal(batch.rewards, padded.rewards)
    ns = run_snippet(found)
    again = padding_reading_estimator(ns["batch"]), padding_reading_estimator(ns["padded"])
    assert not torch.allclose(*again)  # the pasted snippet reproduces the failure


def test_the_correct_estimator_passes_where_the_broken_one_fails():
    rgt.check_estimator(lambda b: F.group_normalize(b.rewards, b.group))


def test_an_exception_in_the_checked_function_is_a_counterexample():
    def needs_two_rows(b):
        return b.rewards[1] - b.rewards[0]

    found = caught(rgt.assert_group_permutation_equivariant, needs_two_rows)
    assert found.batch.N == 1 and "IndexError" in found.message


def test_microbatch_losses_runs_each_piece_under_the_global_counts():
    batch = RolloutBatch.of(group=[0, 0], mask=[[True, True], [True, False]], advantages=[[1.0, 1.0], [1.0, 0.0]])
    parts = microbatch_losses(lambda b: F.token_mean(-b.advantages, b.mask), batch, [[0], [1]])
    assert [float(p) for p in parts] == pytest.approx([-2 / 3, -1 / 3])


def test_check_estimator_takes_a_registered_estimator_by_name():
    @F.estimator(name="testing_leave_one_out")
    def leave_one_out(r):  # a singleton group gives 0 (rlgraph's convention; verl passes r through)
        return (r - (r.sum() - r) / max(r.shape[0] - 1, 1)) * (r.shape[0] > 1)

    rgt.check_estimator("testing_leave_one_out")
    rgt.check_estimator(leave_one_out)

    @F.estimator(name="testing_first_sample_baseline")
    def first_sample_baseline(r):  # not equivariant: the baseline depends on which sample comes first
        return r - r[0]

    failure = failure_of(rgt.check_estimator, "testing_first_sample_baseline")
    assert failure.counterexample.prop == "group-permutation equivariance"
    assert failure.counterexample.batch.N <= 4 and failure.counterexample.batch.T == 1  # shrunk small


@pytest.mark.parametrize("name", ["group_normalize", "dr_grpo", "rloo", "gpg", "reinforce_pp_baseline", "opo"])
def test_every_built_in_estimator_passes_check_estimator_by_name(name):
    # 10 examples, not the profile's 25: tests/functional/test_advantages.py runs the same properties on
    # ragged groups at full strength; this test is about the by-name calling convention and its 4 checks
    rgt.check_estimator(name, settings=settings(max_examples=10, derandomize=True, database=None))


def z_score_by_sample_std(b):
    """Broken on purpose: the unbiased std of a one-sample group is NaN (0 / 0)."""
    out = torch.zeros_like(b.rewards)
    for rows in b.groups:
        r = b.rewards[rows]
        out[rows] = (r - r.mean()) / r.std()
    return out


def centred_but_singletons_pass_through(b):
    """Broken on purpose (verl's convention, not rlgraph's): a one-sample group keeps its raw reward."""
    out = b.rewards.clone()
    for rows in b.groups:
        if len(rows) > 1:
            out[rows] = b.rewards[rows] - b.rewards[rows].mean()
    return out


@pytest.mark.filterwarnings("ignore:std\\(\\). degrees of freedom")  # the bug under test warns each draw
def test_an_estimator_that_gives_nan_is_caught_and_the_snippet_shows_the_nan():
    found = caught(rgt.assert_finite, z_score_by_sample_std)
    assert found.batch.N == 1 and found.message == "out[0] is nan"  # shrunk to the one-sample group
    ns = run_snippet(found, z_score_by_sample_std=z_score_by_sample_std)
    assert torch.isnan(ns["out"]).all()


def test_an_estimator_that_passes_a_singleton_reward_through_is_caught():
    found = caught(rgt.assert_singleton_groups_zero, centred_but_singletons_pass_through)
    assert found.batch.N == 1 and found.batch.rewards.abs().item() > 0 and found.batch.group.tolist() == [0]
    ns = run_snippet(found, centred_but_singletons_pass_through=centred_but_singletons_pass_through)
    assert torch.equal(ns["out"], found.batch.rewards)  # the pasted snippet reproduces the raw reward
    rgt.assert_finite(centred_but_singletons_pass_through)  # finite all the same: only the convention catches it
