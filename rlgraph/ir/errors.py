"""rlgraph's error types, re-exported where they were first defined: they live in `rlgraph.errors`,
below every layer, so that data modules (`rlgraph.batches`) can raise them without importing the IR."""

from rlgraph.errors import (  # noqa: F401
    ConfigError, RewardError, RLGraphError, SourceLocation, SpecError, TraceError, VerifyError, did_you_mean,
    user_location,
)
