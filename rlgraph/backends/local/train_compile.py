"""The training forward under `torch.compile`, and when compiling it pays (`train.compile`).

With `LocalExecutor(compile_train=True)` each micro-batch's forward in `update` (the decoder body,
or the critic's values: `role_outputs`) runs compiled by Inductor, and
so does its backward (AOTAutograd compiles the backward of a compiled forward); the loss math stays
eager (it is a few elementwise ops), and so does the LM head (`logprobs.masked_head`): it runs
on the M real tokens of a micro-batch, a data-dependent count over which its chunk loop would make
Dynamo compile one graph per M (the recompiles `rlgraph bench` measured). The rows and the prompt
and response widths are marked dynamic up front (`mark_dynamic_shapes`), so the first micro-batch
compiles the one graph every later shape reuses (a dimension of size 1 may add one more: Dynamo
specialises sizes 0 and 1). Inference forwards (`rg.logprobs`, `rg.values`) stay eager: they run once
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

from rlgraph.batches import Rollouts
from rlgraph.errors import ConfigError

COMPILE_MODES = ("auto", "on", "off")
BREAK_EVEN_FORWARDS = 10_000  # micro-batch forwards a cold CPU compile would need to repay itself (module docstring)


@functools.cache
def compiled_role_outputs() -> Any:
    """`role_outputs` compiled once per process; Dynamo guards on the module, so each role gets its graphs."""
    from rlgraph.backends.local.executor import role_outputs

    return torch.compile(role_outputs)


def mark_dynamic_shapes(rollouts: Rollouts) -> Rollouts:
    """Mark the rows and the prompt and response widths of `rollouts` dynamic before the compiled
    forward sees them, so its first graph already serves every micro-batch shape (without it Dynamo
    compiles a static graph first and a dynamic one at the second shape)."""
    for tensor in (rollouts.prompt_ids, rollouts.prompt_mask, rollouts.response_ids, rollouts.mask,
                   rollouts.logprobs, rollouts.group, rollouts.context_mask):
        if tensor is not None:
            for dim in range(tensor.dim()):
                torch._dynamo.maybe_mark_dynamic(tensor, dim)
    return rollouts


def resolve_train_compile(mode: str, where: str = "train.compile") -> bool:
    """Whether to compile the training forward: `on`, `off`, or `auto` (off: module docstring)."""
    if mode not in COMPILE_MODES:
        raise ConfigError(f"{where}={mode!r} is not one of {', '.join(map(repr, COMPILE_MODES))}",
                          fix=f"{where}=auto (off for now), on, or off")
    return mode == "on"  # auto: off until the recompiles measured in the bench are bounded (module docstring)
