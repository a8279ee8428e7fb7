"""Step kinds and stage timing: one set of names for `rlgraph train`'s metrics and `rlgraph bench`."""

from rlgraph.plan.plan import Offload, Stage, SyncWeights, Transfer
from rlgraph.plan.timing import COMPILE_SECONDS, STEP_SECONDS, seconds_by_kind, stage_metric, step_kind

STEPS = (Stage(0, "policy", "generate", ("a",), ("generate",)), Transfer(1, "gather", "a", "Rollouts", "policy", "controller", 8),
         Stage(2, "controller", "reward", ("b",), ("score",)), SyncWeights(3, "policy", "policy@v1", "p", "g", 64, 1),
         Offload(4, "policy", "optimizer", "offload", 16), Stage(5, "policy", "generate", ("c",), ("generate",)))


def test_each_step_kind_is_what_the_plan_prints_and_the_metric_names_follow():
    assert [step_kind(step) for step in STEPS] == ["generate", "transfer", "reward", "sync_weights", "offload", "generate"]
    assert [stage_metric(kind) for kind in ("generate", "sync_weights")] == ["time/generate_s", "time/sync_weights_s"]
    assert (STEP_SECONDS, COMPILE_SECONDS) == ("time/step_s", "time/compile_s")


def test_seconds_are_summed_by_kind_and_a_step_never_timed_counts_zero():
    totals = seconds_by_kind(STEPS, {0: 0.25, 1: 0.5, 3: 2.0, 5: 0.125})  # the reward and offload steps never ran
    assert totals == {"generate": 0.375, "transfer": 0.5, "reward": 0.0, "sync_weights": 2.0, "offload": 0.0}
    assert seconds_by_kind(STEPS[3:4], {3: 1.0}) == {"sync_weights": 1.0}  # only the kinds of the steps given
    assert seconds_by_kind((), {0: 1.0}) == {}
