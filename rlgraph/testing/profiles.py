"""Hypothesis settings profiles: `fast` for CI, `thorough` for a nightly run.

    rlgraph.testing.load_profile()            # reads HYPOTHESIS_PROFILE, default "fast"
    HYPOTHESIS_PROFILE=thorough make test     # the nightly command (docs/testing.md)

`fast` runs 25 examples per property, derandomized: the same examples on every run, so CI is a
fixed regression suite that cannot flake on a newly drawn example (the whole rlgraph suite stays
within its CI budget). `thorough` runs 500 fresh random examples per property, to find new
counterexamples (a nightly job); neither keeps a deadline. Both suppress the too-slow health check: RL
properties build tensors and sometimes models, which hypothesis would otherwise flag.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

PROFILES = {
    "fast": dict(max_examples=25, derandomize=True),  # the same examples every run: CI never flakes
    "thorough": dict(max_examples=500),                # fresh random examples every night
}
_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def register_profiles() -> None:
    for name, options in PROFILES.items():
        settings.register_profile(name, **options, **_COMMON)
    settings.register_profile("ci", parent=settings.get_profile("fast"))  # the old name of `fast`


def load_profile(name: str | None = None) -> str:
    """Register and load `name` (default: $HYPOTHESIS_PROFILE, else "fast"); returns the name loaded."""
    register_profiles()
    chosen = name or os.environ.get("HYPOTHESIS_PROFILE", "fast")
    settings.load_profile(chosen)
    return chosen
