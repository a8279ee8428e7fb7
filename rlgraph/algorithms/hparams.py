"""The ranges of the algorithms' shared hyper-parameters, checked where an algorithm starts tracing.

    check_hparams("grpo", clip=clip, kl=kl)   # kl=-0.1 -> TraceError at grpo's line, naming kl

A bad value that would still run (a negative KL coefficient rewards drifting from the reference,
lam=1.5 makes GAE diverge) is refused here rather than trained on silently.
"""

from __future__ import annotations

import sys
from typing import Any

from rlgraph.ir.number_checks import check_group_size, check_number
from rlgraph.errors import user_location

# name -> the keyword arguments of `check_number` that bound it
RULES: dict[str, dict[str, Any]] = {
    "n": dict(low=1, integer=True),
    "clip": dict(low=0, why="the ratio is clipped to [1 - clip, 1 + clip]"),
    "clip_low": dict(low=0),
    "clip_high": dict(low=0, optional=True),
    "value_clip": dict(low=0, low_open=True),
    "kl": dict(low=0, why="a negative coefficient rewards moving away from the reference"),
    "kl_target": dict(low=0, low_open=True, optional=True),
    "kl_horizon": dict(low=1),
    "gamma": dict(low=0, high=1),
    "lam": dict(low=0, high=1, why="GAE sums (gamma lam)^l; above 1 it grows with the length"),
    "epochs": dict(low=1, integer=True),
    "minibatches": dict(low=1, integer=True),
    "micro_batch_size": dict(low=1, integer=True, optional=True),
    "max_new_tokens": dict(low=1, integer=True, optional=True),
    "max_rounds": dict(low=1, high=1000, integer=True, why="each round generates a whole batch; more than 1000 "
                       "is a run that never ends when every group keeps equal rewards"),
    "overlong_buffer": dict(low=1, integer=True),
    # VAPO
    "alpha": dict(low=0, low_open=True, why="the policy's GAE lambda is 1 - 1 / (alpha * length)"),
    "lam_critic": dict(low=0, high=1, why="GAE sums (gamma lam)^l; above 1 it grows with the length"),
    "lm_coef": dict(low=0, why="a negative weight pushes the correct samples' likelihood down"),
    "positive_reward": dict(),
    "value_warmup": dict(low=0, integer=True),
}


def check_hparams(algorithm: str, *, group_estimator: str | None = None, **values: Any) -> None:
    """Check each of `values` against `RULES`; `group_estimator` (its name) also needs n >= 2."""
    where = user_location(sys._getframe(1))  # the algorithm's line, not this helper's
    for name, value in values.items():
        check_number(algorithm, name, value, where=where, **RULES[name])
    if group_estimator is not None:
        check_group_size(algorithm, values["n"], f"the group estimator {group_estimator!r}", where=where)
