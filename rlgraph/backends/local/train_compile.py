"""The training forward under `torch.compile`, and when compiling it pays (`train.compile`).

With `LocalExecutor(compile_train=True)` each micro-batch's forward in `update` (the decoder body,
or the critic's values: `role_outputs`) runs compiled by Inductor, and
so does its backward (AOTAutograd compiles the backward of a compiled forward); the loss math stays
eager (the plan's loss closure). The LM head is in the graph where the f32 logits of every
position fit the chunked head's one-block floor (`logprobs.head_fits_one_block`: small
vocabularies): `logprobs.all_positions_head` runs it over all N x T positions and drops the
padding, so the graph has no graph break and one backward. Elsewhere it runs eager
(`logprobs.masked_head`): on the M real tokens of a micro-batch, a data-dependent count over which
its chunk loop would make Dynamo compile one graph per M (the recompiles `rlgraph bench` measured). The rows and the prompt
and response widths are marked dynamic up front (`mark_dynamic_shapes`), so the first micro-batch
compiles the one graph every later shape reuses (a dimension of size 1 may add one more: Dynamo
specialises sizes 0 and 1). The inference forwards (`rg.logprobs`, `rg.values`: reference and old
log-probs, critic values) go through the same compiled function: under `no_grad` and in eval mode
Dynamo compiles one more graph, which every role of the same architecture shares (the modules are
inlined, their parameters are graph inputs), so a run compiles two graphs in all.

`auto` (the config's default) compiles where it was measured to pay. In `rlgraph bench`
(docs/benchmarks.md, "Compiled training step in the bench") the train stage of a step (one
8-row micro-batch) ran 1.17-1.32x faster compiled on the small configuration (~3 ms saved an
update) and 1.21-1.30x on the large one (~60 ms saved), against a cold compile of the dynamic
graph of 110-140 s on the loaded 2-core CPU (11-18 s from a warm Inductor cache). The smaller
saving sets the break-even: 139 s / 2.9 ms = ~48,000 micro-batches, so `auto` compiles a CPU run
that trains at least `AUTO_MIN_FORWARDS` micro-batch forwards (from `train.steps`; a run bounded
only by `train.seconds` has no count and stays eager), and is off on CUDA, where nothing was measured.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from rlgraph.backends.local.logprobs import role_outputs
from rlgraph.batches import Rollouts
from rlgraph.errors import ConfigError

COMPILE_MODES = ("auto", "on", "off")
AUTO_MIN_FORWARDS = 50_000  # micro-batch forwards a cold CPU compile needs to repay itself (module docstring)


@functools.cache
def compiled_role_outputs(device_type: str = "cpu") -> Any:
    """`role_outputs` compiled once per process and device type; Dynamo guards on the module, so
    each role gets its graphs. On the CPU with Inductor's C++ wrapper (as the decode step,
    `lean_decode.compiled_decode_step`): the same kernels, called without Python in between
    (forward + loss + backward of the small bench's micro-batch 5.93 against 6.34 ms thread CPU;
    docs/benchmarks.md, "The update and reference stages")."""
    return torch.compile(role_outputs, options={"cpp_wrapper": True} if device_type == "cpu" else None)


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


def resolve_train_compile(mode: str, device: str, forwards: int | None, where: str = "train.compile") -> bool:
    """Whether to compile the training forward: `on`, `off`, or `auto` (module docstring).

    `forwards`: the micro-batch forwards the run will train (None: unknown)."""
    if mode not in COMPILE_MODES:
        raise ConfigError(f"{where}={mode!r} is not one of {', '.join(map(repr, COMPILE_MODES))}",
                          fix=f"{where}=auto (compile where it pays), on, or off")
    if mode != "auto":
        return mode == "on"
    return torch.device(device).type == "cpu" and forwards is not None and forwards >= AUTO_MIN_FORWARDS
