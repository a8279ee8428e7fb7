"""`pack`: put the compile option `micro_batch_tokens` on every model forward of the program.

With `rg.compile(micro_batch_tokens=k)` (config `train.micro_batch_tokens`) every `update`,
`logprobs` and `values` node gets `micro_batch_tokens=k` in its arguments: the executor packs the
node's rows into micro-batches of at most k real tokens and runs them without padding
(`rlgraph.backends.local.packing`). The plan prints the argument and the packed micro-batches, and
the memory plan counts their k tokens instead of rows x (P+T).

An update that sets its own `micro_batch_tokens` keeps it; one that sets `micro_batch_size` is
refused, since the two would size its micro-batches differently; so is a node with `vocab=True`
(its `[N, T, V]` distributions are computed on padded rows).

Guarantees: values and specs are unchanged; only these nodes' `micro_batch_tokens` is added.
"""

from __future__ import annotations

from rlgraph.errors import ConfigError
from rlgraph.ir.primitives import primitive_name
from rlgraph.ir.program import Program, copy_program
from rlgraph.passes.options import CompileOptions, check_micro_batch_tokens

PACKED = ("update", "logprobs", "values")


def pack(program: Program, options: CompileOptions) -> Program:
    budget = options.micro_batch_tokens
    out, _ = copy_program(program)
    for node in out.graph.nodes:
        name = primitive_name(node)
        if name not in PACKED:
            continue
        own = node.kwargs.get("micro_batch_tokens")
        if own is not None:  # the algorithm's own budget must hold a full-length row of these sizes too
            try:
                check_micro_batch_tokens(own, options.sizes)
            except ConfigError as error:
                raise ConfigError(f"rg.update of {node.name} (loss {node.meta['program'].name}): {error.summary}",
                                  fix=error.fix) from None
        if budget is None or own is not None:
            continue
        if node.kwargs.get("vocab"):  # the [N, T, V] distributions are padded rows' (`vocabulary_logprobs`)
            raise ConfigError(f"micro_batch_tokens={budget}: {name} {node.name} takes vocab=True, the distribution over "
                              "the vocabulary at each position of padded rows, which packed sequences do not give",
                              fix="drop micro_batch_tokens (train.micro_batch_tokens) for this algorithm, or vocab=False")
        if name == "update" and node.kwargs["micro_batch_size"] is not None:
            raise ConfigError(f"micro_batch_tokens={budget}: update {node.name} (loss {node.meta['program'].name}) sets "
                              f"micro_batch_size={node.kwargs['micro_batch_size']}; both would size its micro-batches",
                              fix="leave the algorithm's micro_batch_size at None when packing by tokens, or drop "
                                  "micro_batch_tokens")
        node.kwargs = {**node.kwargs, "micro_batch_tokens": budget}
    return out.verify(after="pack")
