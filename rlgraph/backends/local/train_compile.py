"""The training forward under `torch.compile`, and when compiling it pays (`train.compile`).

With `LocalExecutor(compile_train=True)` each micro-batch's forward in `update` (the decoder and
the chunked log-prob head, or the critic's values: `role_outputs`) runs compiled by Inductor, and
so does its backward (AOTAutograd compiles the backward of a compiled forward); the loss math stays
eager (it is a few elementwise ops). The first micro-batch of each new shape pays the compile;
the second distinct shape makes Dynamo compile a dynamic-shape graph, after which row counts and
prompt widths reuse it. Inference forwards (`rg.logprobs`, `rg.values`) stay eager: they run once
per step, under `no_grad`, where the compiled graph would be another compile.

`auto` (the config's default) is off for now. docs/benchmarks.md ("Training step: eager vs
torch.compile") measured 1.34x on one update's forward+backward on the CPU (~2.3 ms saved per
64-row micro-batch of the tiny model) against a ~24 s cold compile, which would repay after
~`BREAK_EVEN_FORWARDS` micro-batches; but in `rlgraph bench` (docs/benchmarks.md, "Compiled decode
in runs") the compiled update recompiled as the batches' shapes changed: 0.21x TRL's speed on the
large configuration, where nearly every step compiled. Until those recompiles are understood and
bounded, `auto` never compiles the training forward; `on` does, where asked.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from rlgraph.errors import ConfigError

COMPILE_MODES = ("auto", "on", "off")
BREAK_EVEN_FORWARDS = 10_000  # micro-batch forwards a cold CPU compile would need to repay itself (module docstring)


@functools.cache
def compiled_role_outputs() -> Any:
    """`role_outputs` compiled once per process; Dynamo guards on the module, so each role gets its graphs."""
    from rlgraph.backends.local.executor import role_outputs

    return torch.compile(role_outputs)


def resolve_train_compile(mode: str, where: str = "train.compile") -> bool:
    """Whether to compile the training forward: `on`, `off`, or `auto` (off: module docstring)."""
    if mode not in COMPILE_MODES:
        raise ConfigError(f"{where}={mode!r} is not one of {', '.join(map(repr, COMPILE_MODES))}",
                          fix=f"{where}=auto (off for now), on, or off")
    return mode == "on"  # auto: off until the recompiles measured in the bench are bounded (module docstring)
