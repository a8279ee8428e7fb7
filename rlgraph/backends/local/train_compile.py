"""The training forward under `torch.compile`, and when compiling it pays (`train.compile`).

With `LocalExecutor(compile_train=True)` each micro-batch's forward in `update` (the decoder and
the chunked log-prob head, or the critic's values: `role_outputs`) runs compiled by Inductor, and
so does its backward (AOTAutograd compiles the backward of a compiled forward); the loss math stays
eager (it is a few elementwise ops). The first micro-batch of each new shape pays the compile;
the second distinct shape makes Dynamo compile a dynamic-shape graph, after which row counts and
prompt widths reuse it. Inference forwards (`rg.logprobs`, `rg.values`) stay eager: they run once
per step, under `no_grad`, where the compiled graph would be another compile.

`auto` (the config's default) compiles only where it is measured to pay: docs/benchmarks.md
("Training step: eager vs torch.compile") measured 1.34x on the update's forward+backward on
the CPU (~2.3 ms saved per 64-row micro-batch of the tiny model) against a ~24 s cold compile,
so it repays after ~10,000 micro-batches. `auto` is therefore on for a CPU run that trains at
least `AUTO_MIN_FORWARDS` micro-batches (from `train.steps`; a run bounded only by
`train.seconds` has no count and stays eager), and off on CUDA, where nothing was measured.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from rlgraph.errors import ConfigError

COMPILE_MODES = ("auto", "on", "off")
AUTO_MIN_FORWARDS = 10_000  # micro-batch forwards a cold CPU compile needs to repay itself (module docstring)


@functools.cache
def compiled_role_outputs() -> Any:
    """`role_outputs` compiled once per process; Dynamo guards on the module, so each role gets its graphs."""
    from rlgraph.backends.local.executor import role_outputs

    return torch.compile(role_outputs)


def resolve_train_compile(mode: str, device: str, forwards: int | None, where: str = "train.compile") -> bool:
    """Whether to compile the training forward: `on`, `off`, or `auto` (module docstring).

    `forwards`: the micro-batch forwards the run will train (None: unknown)."""
    if mode not in COMPILE_MODES:
        raise ConfigError(f"{where}={mode!r} is not one of {', '.join(map(repr, COMPILE_MODES))}",
                          fix=f"{where}=auto (compile where it pays), on, or off")
    if mode != "auto":
        return mode == "on"
    return torch.device(device).type == "cpu" and forwards is not None and forwards >= AUTO_MIN_FORWARDS
