"""rlgraph.testing: property-based testing of RL dataflows, for your test suite and ours.

Strategies (hypothesis) draw the inputs RL code meets: ragged rollout batches with empty rows,
tied and extreme rewards, large log-ratios; micro-batch splits; meshes and placements; random
well-typed algorithms. Checkers state the properties every loss, estimator and plan must have and
run them in one line; a failure prints the shrunk counterexample as code to paste into a test.

    from rlgraph import testing as rgt

    def test_my_loss():
        rgt.assert_microbatch_invariant(lambda b: my_loss(b.logprobs, b.old_logprobs, b.advantages, b.mask))

See docs/testing.md for the full tour. Needs hypothesis: `pip install 'rlgraph[testing]'`.
"""

try:
    import hypothesis  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("rlgraph.testing needs hypothesis; install it with: pip install 'rlgraph[testing]'") from exc

from rlgraph.testing.batch import FIELDS, ROW_FIELDS, TOKEN_FIELDS, RolloutBatch
from rlgraph.testing.checks import (
    assert_finite, assert_group_permutation_equivariant, assert_microbatch_invariant, assert_padding_invariant,
    assert_singleton_groups_zero, check_estimator, check_loss, microbatch_losses,
)
from rlgraph.testing.counterexample import Counterexample, PropertyFailure
from rlgraph.testing.plans import (
    assert_compiled_matches_eager, assert_plan_invariants, assert_reshard_round_trip, assert_update_microbatch_invariant,
)
from rlgraph.testing.profiles import PROFILES, load_profile, register_profiles
from rlgraph.testing.programs import GeneratedAlgorithm, algorithms
from rlgraph.testing.strategies import (
    group_permutations, layouts, meshes, micro_batch_splits, padding_of, placements, reward_values, rollout_batches,
    sizes, tensor_specs, tensors_of,
)
from rlgraph.testing.tiny import tiny_executor, tiny_prompts

__all__ = [
    "FIELDS", "ROW_FIELDS", "TOKEN_FIELDS", "RolloutBatch",
    "assert_finite", "assert_group_permutation_equivariant", "assert_microbatch_invariant", "assert_padding_invariant",
    "assert_singleton_groups_zero", "check_estimator", "check_loss", "microbatch_losses",
    "Counterexample", "PropertyFailure",
    "assert_compiled_matches_eager", "assert_plan_invariants", "assert_reshard_round_trip", "assert_update_microbatch_invariant",
    "PROFILES", "load_profile", "register_profiles",
    "GeneratedAlgorithm", "algorithms",
    "group_permutations", "layouts", "meshes", "micro_batch_splits", "padding_of", "placements", "reward_values",
    "rollout_batches", "sizes", "tensor_specs", "tensors_of",
    "tiny_executor", "tiny_prompts",
]
