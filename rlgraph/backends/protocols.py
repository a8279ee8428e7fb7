"""The small protocols executors implement. The runtime talks to workers only through these.

A model version at run time is a `ModelRef(role, version)`; an executor holds the live weights
of each role and refuses a stale version (the dataflow made weight versions explicit, so a stale
read is a bug in the plan or the caller, never silently the wrong weights).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import attrs
import torch

from rlgraph.batches import Prompts, Rollouts


@attrs.frozen
class ModelRef:
    role: str
    version: int

    def __str__(self) -> str:
        return f"{self.role}@{self.version}"


@attrs.frozen
class RewardRef:
    role: str


@attrs.frozen
class EnvRef:
    """An environment role of a running plan (`state.env`): the executor holds its recipe."""

    role: str


@attrs.frozen
class LossCounts:
    """The token and sequence counts of a whole mini-batch, across every data-parallel rank.

    The executor computes them (summing its shard's counts over its data-parallel group), so a loss
    aggregated per micro-batch and per rank adds up to the full-batch loss."""

    tokens: torch.Tensor
    sequences: torch.Tensor


# loss_fn(micro_rows, counts, model_output[N_micro,T], entropy or None) -> (loss, metrics)
LossFn = Callable[[torch.Tensor, LossCounts, torch.Tensor, "torch.Tensor | None"], tuple[torch.Tensor, Mapping[str, torch.Tensor]]]


@attrs.frozen
class UpdateConfig:
    epochs: int = 1
    minibatches: int = 1
    micro_batch_size: int | None = None
    grad_clip: float | None = 1.0
    temperature: float = 1.0
    shuffle: bool = False
    on_nonfinite: str = "raise"  # or "skip": a mini-batch with a NaN/inf gradient norm is dropped and counted
    # Set by the plan (`TrainLayout.grad_sync_last`), not the algorithm: reduce gradients across
    # ranks on the last micro-batch of each optimizer step only.
    grad_sync_last: bool = False
    step: bool = True  # False: accumulate gradients only (no zero_grad, no step); `optimizer_step` applies them
    outputs: bool = False  # also return the training forward's per-token outputs [N, T], detached
    # Packed sequences: micro-batches of at most this many real tokens, run without padding
    # (`rlgraph.backends.local.packing`); None: micro-batches of `micro_batch_size` rows, padded.
    micro_batch_tokens: int | None = None
    vocab: bool = False  # the loss reads the log-softmax over the vocabulary [N, T, V], not the tokens' log-probs

    def __attrs_post_init__(self) -> None:
        if self.on_nonfinite not in ("raise", "skip"):
            raise ValueError(f"update: on_nonfinite must be 'raise' or 'skip', got {self.on_nonfinite!r}")
        if self.epochs < 1 or self.minibatches < 1:
            raise ValueError(f"update: epochs and minibatches must be >= 1, got {self.epochs}, {self.minibatches}")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError(f"update: micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.micro_batch_tokens is not None:
            from rlgraph.backends.local.packing import check_budget

            check_budget(self.micro_batch_tokens, "update")
        if self.micro_batch_tokens is not None and self.micro_batch_size is not None:
            raise ValueError(f"update: micro_batch_size={self.micro_batch_size} and micro_batch_tokens="
                             f"{self.micro_batch_tokens} both size the micro-batches; give one")


@attrs.frozen
class RoleState:
    """One model role as a checkpoint holds it: the full (unsharded) weights, a full optimizer
    state dict in the order of `model.parameters()` (None for a frozen role), its kind and version."""

    model: Mapping[str, torch.Tensor]
    optimizer: Mapping[str, Any] | None
    optimizer_kind: str | None
    version: int


@attrs.frozen
class ExecutorState:
    """Everything an executor's future depends on: its roles and its random streams.

    The same object comes from one process (`LocalExecutor.export_state`) or from N ranks
    (the backend that built the ranks merges their shards: `RankRecipe.merge_states`), so a checkpoint
    resumes on any runtime."""

    roles: Mapping[str, RoleState]
    shuffle_rng: torch.Tensor
    sampling: Mapping[str, int]


class Executor(Protocol):
    """Runs the primitives for every role it holds, on `device` (where the runtime puts the values
    it hands over: a batch to train on, a rank's scattered pieces)."""

    device: torch.device

    def current(self, role: str) -> ModelRef: ...

    def generate(self, model: ModelRef, prompts: Prompts, *, n: int, temperature: float, top_p: float,
                 max_new_tokens: int | None, stop: Sequence[str] = ()) -> Rollouts: ...

    def rollout(self, model: ModelRef, env: EnvRef, prompts: Prompts, *, n: int, temperature: float, top_p: float,
                max_turns: int, max_tokens_per_turn: int | None, max_total_tokens: int | None,
                step_timeout: float | None, env_workers: int | None = None, env_memory_mb: int = 4096
                ) -> tuple[Rollouts, torch.Tensor, torch.Tensor]: ...

    def logprobs(self, model: ModelRef, rollouts: Rollouts, *, temperature: float, entropy: bool, vocab: bool = False,
                 micro_batch_tokens: int | None = None) -> Any: ...

    def values(self, model: ModelRef, rollouts: Rollouts, *, micro_batch_tokens: int | None = None) -> torch.Tensor: ...

    def score(self, reward: RewardRef, rollouts: Rollouts) -> torch.Tensor: ...

    def update(self, model: ModelRef, batch: Rollouts, loss_fn: LossFn, config: UpdateConfig) -> tuple[ModelRef, dict[str, float]]: ...

    def optimizer_step(self, model: ModelRef, *, lr: float | None, betas: tuple[float, float] | None,
                       eps: float | None, weight_decay: float | None, grad_clip: float | None
                       ) -> tuple[ModelRef, dict[str, float]]: ...

    def sync_weights(self, model: ModelRef, route: Any = None) -> ModelRef:
        """Load `model`'s weights into the generation engine that serves it (`route`: where from and to)."""
        ...


class RankRecipe(Protocol):
    """What a remote transport asks of the backend that builds its ranks (`rlgraph.backends.world.WorldSpec`).

    The transport moves rank answers as opaque data; only the backend knows how a rank holds its
    share of a role (FSDP2 shards, say), so only it turns the ranks' answers back into whole values.
    """

    def build(self, rank: int, plan: Any, device: torch.device) -> Executor:
        """Rank `rank`'s executor for `plan` (inside the job's torch.distributed process group)."""
        ...

    def controller(self) -> Executor:
        """The controller's executor: reward functions and the tokenizer, no models."""
        ...

    def merge_states(self, parts: Mapping[int, Any]) -> ExecutorState:
        """The full checkpoint state from every rank's `export_state()` answer (rank -> part)."""
        ...

    def full_weights(self, role: str, parts: Mapping[int, Any]) -> dict[str, torch.Tensor]:
        """`role`'s full weights from every rank's `full_state(role)` answer (rank -> part)."""
        ...
