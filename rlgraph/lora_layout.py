"""How an executor lays out a colocated LoRA role: a rule the backends build by and the plan's memory
model counts by, so it sits below both layers (as `rlgraph.errors` does) and imports only torch."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def shares_lora_base(targets: Iterable[str], *, trains: bool, engine: str | None, param_dtype: torch.dtype) -> bool:
    """Whether a LoRA role's generation engine runs on the role's own frozen base, as the FSDP2
    executor builds it (`rlgraph.backends.fsdp.build.shares_base`): the role trains and generates on
    the same ranks (`engine` is its group's: None when it does not generate) with the native engine,
    which holds weights in the role's dtype (fp32: a cpu device), and no adapter wraps the LM head
    (tied to the embedding in Qwen2.5: a merged head would untie them)."""
    return trains and engine not in ("vllm", "none") and param_dtype == torch.float32 and "lm_head" not in set(targets)
