"""rg.filter_groups: which groups the update sees, the refill loop, and the errors.

A scripted executor makes every round exact: prompt k's meta lists the rewards of its n samples,
and sample j of prompt k has j + 1 + (k's `extra`) response tokens, so rounds differ in T.
"""

import pytest
import torch

import rlgraph as rg
from rlgraph import functional as F
from rlgraph.backends.protocols import ModelRef
from rlgraph.batches import Prompts, Rollouts
from rlgraph.errors import TraceError
from rlgraph.runtime.eager import Interpreter
from rlgraph.runtime.plan_runner import PlanRunner
from rlgraph.runtime.refill import RefillError


class ScriptedExecutor:
    """generate: one row per (prompt, sample); score: the scripted rewards; update: records its batch."""

    device = torch.device("cpu")

    def __init__(self):
        self.version = 0
        self.batches: list[Rollouts] = []

    def current(self, role):
        return ModelRef(role, self.version)

    def generate(self, model, prompts, *, n, temperature, top_p, max_new_tokens, stop=()):
        rows = len(prompts) * n
        steps = 2 + max(prompts.meta["extra"])
        lengths = torch.tensor([j + 1 + extra for extra in prompts.meta["extra"] for j in range(n)])  # [N]
        mask = torch.arange(steps)[None, :] < lengths[:, None]  # [N, T]
        meta = {"name": [f"{name}/{j}" for name in prompts.meta["name"] for j in range(n)],
                "reward": [r for rewards in prompts.meta["rewards"] for r in rewards]}
        return Rollouts(prompts.ids.repeat_interleave(n, 0), prompts.mask.repeat_interleave(n, 0),
                        torch.ones(rows, steps, dtype=torch.long), mask, torch.zeros(rows, steps),
                        torch.arange(len(prompts)).repeat_interleave(n), meta)

    def score(self, reward, rollouts):
        return torch.tensor(rollouts.meta["reward"])

    def update(self, model, batch, loss_fn, config):
        self.batches.append(batch)
        self.version += 1
        return ModelRef(model.role, self.version), {"loss": 0.0, "grad_norm": 0.0}

    def sync_weights(self, model, route=None):  # one process: the generator already holds the weights
        return model


def scripted(name, groups, extra=0):
    """A Prompts batch: one prompt per entry of `groups` (the rewards of its samples)."""
    count = len(groups)
    return Prompts(torch.ones(count, 3, dtype=torch.long), torch.ones(count, 3, dtype=torch.bool),
                   {"name": [f"{name}{k}" for k in range(count)], "rewards": groups, "extra": [extra] * count})


def source(*batches):
    pending = list(batches)

    def more():
        assert pending, "the refill loop drew more prompts than the test scripted"
        return pending.pop(0)

    return more


@rg.algorithm
def keep_varied(state: rg.State, prompts: rg.Prompts, *, n=2, max_rounds=3):
    ro = rg.generate(state.policy, prompts, n=n)
    r = rg.score(state.reward, ro)
    ro, r = rg.filter_groups(ro, r, F.group_has_variance(r, ro.group), max_rounds=max_rounds)
    policy = rg.update(state.policy, ro, lambda lp: F.token_mean(lp, ro.mask))
    return state.replace(policy=policy), {"reward": r.mean()}


def run(program, first, more=None):
    executor = ScriptedExecutor()
    _, metrics = Interpreter(executor).run(program, first, more_prompts=more)
    return executor.batches[0], metrics


def run_plan(algorithm, first, more, **hparams):
    """`run`, through the compiled plan: the plan runner's refill loop re-runs plan steps."""
    compiled = rg.compile(algorithm, mesh="cpu:1", placement=rg.colocated(offload=False, checkpointing=False),
                          sizes={"B": len(first), "P": 3, "T": 4}, **hparams)
    executor = ScriptedExecutor()
    _, metrics = PlanRunner(compiled, executor).run(first, more_prompts=more)
    return executor.batches[0], metrics


DEAD, LIVE = [1.0, 1.0], [0.0, 1.0]


def test_dropped_groups_are_refilled_from_fresh_prompts():
    first = scripted("a", [DEAD, LIVE, [0.0, 0.0], [1.0, 0.0]])
    second = scripted("b", [LIVE, DEAD, [1.0, 0.0], LIVE], extra=2)
    batch, metrics = run(keep_varied.trace(), first, source(second))
    assert batch.meta["name"] == ["a1/0", "a1/1", "a3/0", "a3/1", "b0/0", "b0/1", "b2/0", "b2/1"]  # first B kept groups
    assert batch.group.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert batch.mask.shape == (8, 4) and batch.mask.sum(-1).tolist() == [1, 2, 1, 2, 3, 4, 3, 4]  # padded to the longest T
    assert metrics["filter/rounds"] == 2 and metrics["filter/kept_groups"] == 0.5 and metrics["filter/filled_groups"] == 0
    assert metrics["reward"] == 0.5


@pytest.mark.parametrize("max_rounds", [2, 3])
def test_the_plan_runner_refills_exactly_as_the_interpreter(max_rounds):
    """One refill loop (`run_filter`): the runtimes differ only in what a round re-runs."""
    first = scripted("a", [DEAD, LIVE, [0.0, 0.0], [1.0, 0.0]])
    later = [scripted("b", [DEAD, DEAD, DEAD, DEAD], extra=1), scripted("c", [LIVE, DEAD, LIVE, LIVE], extra=2)]
    eager = run(keep_varied.trace(max_rounds=max_rounds), first, source(*later))
    plan = run_plan(keep_varied, first, source(*later), max_rounds=max_rounds)
    assert plan[0].meta["name"] == eager[0].meta["name"] and torch.equal(plan[0].mask, eager[0].mask)
    assert plan[1] == eager[1] and plan[1]["filter/rounds"] == max_rounds


def test_a_full_first_round_draws_no_prompts():
    first = scripted("a", [LIVE, LIVE])
    batch, metrics = run(keep_varied.trace(), first, source())
    assert batch.meta["name"] == ["a0/0", "a0/1", "a1/0", "a1/1"] and metrics["filter/rounds"] == 1


def test_when_rounds_run_out_dropped_groups_fill_the_batch():
    first = scripted("a", [DEAD, LIVE, DEAD])
    batch, metrics = run(keep_varied.trace(max_rounds=2), first, source(scripted("b", [DEAD, DEAD, DEAD])))
    assert batch.meta["name"] == ["a1/0", "a1/1", "a0/0", "a0/1", "a2/0", "a2/1"]  # kept first, then dropped in order
    assert metrics["filter/rounds"] == 2 and metrics["filter/filled_groups"] == 2
    assert metrics["filter/kept_groups"] == pytest.approx(1 / 3)


def test_without_a_prompt_source_the_run_stops_before_generating():
    executor = ScriptedExecutor()
    with pytest.raises(RefillError) as exc:
        Interpreter(executor).run(keep_varied.trace(), scripted("a", [LIVE]))
    text = str(exc.value)
    assert "no prompt source" in text and "test_refill.py" in text and "rg.filter_groups(" in text
    assert "more_prompts=" in text and "max_rounds=1" in text
    _, metrics = Interpreter(executor).run(keep_varied.trace(max_rounds=1), scripted("a", [DEAD, LIVE]))
    assert metrics["filter/filled_groups"] == 1  # one round needs no source


def test_keep_must_be_constant_within_a_group():
    @rg.algorithm
    def per_row(state: rg.State, prompts: rg.Prompts):
        ro = rg.generate(state.policy, prompts, n=2)
        r = rg.score(state.reward, ro)
        ro, r = rg.filter_groups(ro, r, r > 0)  # E-rowwise
        return state, {"reward": r.mean()}

    with pytest.raises(RefillError, match="same for every row of a group") as exc:
        Interpreter(ScriptedExecutor()).run(per_row.trace(), scripted("a", [LIVE]), more_prompts=source())
    assert "E-rowwise" in str(exc.value) and "group_has_variance" in str(exc.value)


def test_values_from_before_the_filter_cannot_be_used_after_it():
    @rg.algorithm
    def stale(state: rg.State, prompts: rg.Prompts):
        ro = rg.generate(state.policy, prompts, n=2)
        r = rg.score(state.reward, ro)
        kept, kept_r = rg.filter_groups(ro, r, F.group_has_variance(r, ro.group))
        adv = F.group_normalize(kept_r, ro.group)  # E-stale: the unfiltered groups
        return state, {"adv": adv.mean()}

    with pytest.raises(rg.TraceError, match="computed before rg.filter_groups") as exc:
        stale.trace()
    assert "E-stale" in str(exc.value) and "fix:" in str(exc.value)


def test_the_filtered_reward_may_not_be_reported_unfiltered():
    @rg.algorithm
    def report(state: rg.State, prompts: rg.Prompts):
        ro = rg.generate(state.policy, prompts, n=2)
        r = rg.score(state.reward, ro)
        mean = r.mean()  # E-mean
        rg.filter_groups(ro, r, F.group_has_variance(r, ro.group))
        return state, {"reward": mean}

    with pytest.raises(rg.TraceError, match=r"this line uses a value computed before rg.filter_groups \(score:f32\[N\]\)") as exc:
        report.trace()
    assert "E-mean" in str(exc.value)

    @rg.algorithm
    def centred(state: rg.State, prompts: rg.Prompts):
        ro = rg.generate(state.policy, prompts, n=2)
        r = rg.score(state.reward, ro)
        mean = r.mean()
        rg.filter_groups(ro, r, F.group_has_variance(r - mean, ro.group))  # E-filter
        return state, {"reward": mean}

    with pytest.raises(rg.TraceError, match="the output 'reward' uses") as exc:
        centred.trace()
    assert "E-filter" in str(exc.value)


def test_an_update_inside_the_refill_loop_is_refused():
    @rg.algorithm
    def early(state: rg.State, prompts: rg.Prompts):
        ro = rg.generate(state.policy, prompts, n=2)
        policy = rg.update(state.policy, ro, lambda lp: lp.mean())  # E-early
        r = rg.score(state.reward, ro) + 0 * rg.logprobs(policy, ro).sum(-1)
        ro, r = rg.filter_groups(ro, r, F.group_has_variance(r, ro.group))
        return state.replace(policy=policy), {"reward": r.mean()}

    with pytest.raises(rg.TraceError, match="would repeat the update or use the old weights") as exc:
        early.trace()
    assert "E-early" in str(exc.value)


def test_filter_groups_needs_prompts_a_bool_keep_and_one_call():
    @rg.algorithm
    def on_rollouts(state: rg.State, batch: rg.Rollouts):
        r = batch.logprobs.sum(-1)
        batch, r = rg.filter_groups(batch, r, F.group_has_variance(r, batch.group))
        return state, {"r": r.mean()}

    with pytest.raises(rg.TraceError, match="must be rg.Prompts"):
        on_rollouts.trace()

    @rg.algorithm
    def float_keep(state: rg.State, prompts: rg.Prompts):
        ro = rg.generate(state.policy, prompts, n=2)
        r = rg.score(state.reward, ro)
        ro, r = rg.filter_groups(ro, r, r)  # E-keep
        return state, {"r": r.mean()}

    with pytest.raises(rg.SpecError, match=r"keep must be a bool tensor \[N\]") as exc:
        float_keep.trace()
    assert "E-keep" in str(exc.value)

    @rg.algorithm
    def twice(state: rg.State, prompts: rg.Prompts):
        ro = rg.generate(state.policy, prompts, n=2)
        r = rg.score(state.reward, ro)
        ro, r = rg.filter_groups(ro, r, F.group_has_variance(r, ro.group))
        ro, r = rg.filter_groups(ro, r, F.group_has_variance(r, ro.group))  # E-twice
        return state, {"r": r.mean()}

    with pytest.raises(rg.TraceError, match="once") as exc:
        twice.trace()
    assert "E-twice" in str(exc.value)


def test_group_has_variance_marks_groups_with_unequal_rewards():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.3, 0.3, 0.7])
    group = torch.tensor([0, 0, 1, 1, 2, 2, 3])  # group 3 is a singleton
    assert F.group_has_variance(rewards, group).tolist() == [False, False, True, True, False, False, False]


def test_the_batch_may_not_be_read_after_the_filter():
    @rg.algorithm
    def greedy_after(state: rg.State, prompts: rg.Prompts):
        ro = rg.generate(state.policy, prompts, n=2)
        r = rg.score(state.reward, ro)
        ro, r = rg.filter_groups(ro, r, F.group_has_variance(r, ro.group))
        greedy = rg.generate(state.policy, prompts, n=1, temperature=0.0)  # E-greedy
        baseline = rg.score(state.reward, greedy)
        return state, {"adv": (r - baseline[ro.group]).mean()}

    with pytest.raises(rg.TraceError, match=r"reads the batch prompts:Prompts\[B,P\] after rg.filter_groups") as exc:
        greedy_after.trace()
    assert "E-greedy" in str(exc.value) and "fix:" in str(exc.value)


def test_when_no_round_keeps_a_group_a_warning_says_why_and_the_batch_is_filled(caplog):
    # not an error: a small model early in training may tie every group for a few steps (tests/train/test_loop.py)
    first = scripted("a", [DEAD, DEAD])
    with caplog.at_level("WARNING", logger="rlgraph.runtime.refill"):
        _, metrics = run(keep_varied.trace(max_rounds=3), first,
                         source(scripted("b", [DEAD, DEAD]), scripted("c", [[0.0, 0.0]] * 2)))
    text = caplog.records[-1].getMessage()
    assert "kept no group in 3 rounds (6 groups drawn)" in text and "test_refill.py" in text and "fix:" in text
    assert metrics["filter/filled_groups"] == 2


def test_each_refill_round_reports_its_progress(caplog):
    first = scripted("a", [DEAD, LIVE])
    with caplog.at_level("INFO", logger="rlgraph.runtime.refill"):
        run(keep_varied.trace(max_rounds=3), first, source(scripted("b", [DEAD, DEAD]), scripted("c", [LIVE, DEAD])))
    assert [r.getMessage() for r in caplog.records] == ["rg.filter_groups: round 2/3, kept 1 of 2 groups",
                                                        "rg.filter_groups: round 3/3, kept 2 of 2 groups"]


@pytest.mark.parametrize("max_rounds", [1001, 10**9, 0])
def test_an_absurd_round_cap_is_refused_at_trace_time(max_rounds):
    with pytest.raises(TraceError, match=f"rg.filter_groups: max_rounds={max_rounds} is not valid"):
        keep_varied.trace(max_rounds=max_rounds)
