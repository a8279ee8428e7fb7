"""The local executor: every role in this process, on the CPU (or one local GPU).

Holds the live weights of each role and runs the five primitives:
- `generate` with the native KV-cache engine;
- `logprobs` / `values` without gradients (reference log-probs, old log-probs, critic values);
- `score` by decoding responses and calling the reward function;
- `update`: epochs x mini-batches x micro-batches of the loss closure, gradient accumulation,
  gradient clipping and one optimizer step per mini-batch; bumps the role's version.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch

from rlgraph.backends.local.generation import NativeGenerator, SamplingParams, SamplingStream
from rlgraph.backends.local.logprobs import sequence_logprobs
from rlgraph.backends.protocols import LossFn, ModelRef, RewardRef, UpdateConfig
from rlgraph.batches import Prompts, Rollouts


class StaleVersionError(RuntimeError):
    """A primitive asked for a model version that is not the live one."""


@attrs.define
class LMWorker:
    """A model role. `optimizer=None` makes it frozen (a reference model).

    `kind="critic"` marks a value model (`rlgraph.backends.local.critic.Critic`): `values` and its
    updates use `model.values(rollouts)` in place of the log-probs.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None = None
    version: int = 0
    kind: str = "lm"


@attrs.define
class RewardWorker:
    """A reward role: `fn(completions: list[str], **meta) -> list[float]`."""

    fn: Callable[..., Any]


class LocalExecutor:
    def __init__(self, models: Mapping[str, LMWorker], rewards: Mapping[str, RewardWorker], tokenizer: Any, *,
                 max_new_tokens: int = 16, seed: int = 0):
        self.models = dict(models)
        self.rewards = dict(rewards)
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.generator = torch.Generator().manual_seed(seed)  # mini-batch shuffling
        self.sampling = SamplingStream(seed)  # generation: counter-based, one call per generate

    # -- versions ----------------------------------------------------------------------------
    def current(self, role: str) -> ModelRef:
        return ModelRef(role, self._worker(role).version)

    def _worker(self, role: str) -> LMWorker:
        if role not in self.models:
            raise KeyError(f"the local executor has no model role {role!r}; it has {', '.join(self.models)}")
        return self.models[role]

    def _live(self, ref: ModelRef) -> LMWorker:
        worker = self._worker(ref.role)
        if ref.version != worker.version:
            raise StaleVersionError(
                f"{ref} was requested but {ref.role}@{worker.version} is live; the local executor keeps one version"
            )
        return worker

    # -- primitives --------------------------------------------------------------------------
    def generate(self, model: ModelRef, prompts: Prompts, *, n: int = 1, temperature: float = 1.0,
                 top_p: float = 1.0, max_new_tokens: int | None = None) -> Rollouts:
        worker = self._live(model)
        engine = NativeGenerator(worker.model, eos_token_id=self.tokenizer.eos_token_id,
                                 pad_token_id=self.tokenizer.pad_token_id)
        params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens or self.max_new_tokens)
        return engine.generate(prompts, n, params, seed=self.sampling.seed, call=self.sampling.advance())

    def logprobs(self, model: ModelRef, rollouts: Rollouts, *, temperature: float = 1.0, entropy: bool = False) -> Any:
        worker = self._live(model)
        was_training = worker.model.training
        worker.model.eval()
        try:
            with torch.no_grad():
                return sequence_logprobs(worker.model, rollouts, temperature=temperature, with_entropy=entropy)
        finally:
            worker.model.train(was_training)

    def values(self, model: ModelRef, rollouts: Rollouts) -> torch.Tensor:
        worker = self._live(model)
        if worker.kind != "critic":
            raise ValueError(f"role {model.role!r} is a {worker.kind} model; values need a critic (LMWorker(kind='critic'))")
        with torch.no_grad():
            return worker.model.values(rollouts)

    def score(self, reward: RewardRef, rollouts: Rollouts) -> torch.Tensor:
        if reward.role not in self.rewards:
            raise KeyError(f"the local executor has no reward role {reward.role!r}; it has {', '.join(self.rewards)}")
        completions = decode_responses(self.tokenizer, rollouts)
        values = self.rewards[reward.role].fn(completions, **rollouts.meta)
        scores = torch.as_tensor(values, dtype=torch.float32)
        if scores.shape != (len(rollouts),):
            raise ValueError(f"reward {reward.role!r} returned shape {tuple(scores.shape)}, expected ({len(rollouts)},)")
        return scores

    def update(self, model: ModelRef, batch: Rollouts, loss_fn: LossFn, config: UpdateConfig) -> tuple[ModelRef, dict[str, float]]:
        worker = self._live(model)
        if worker.optimizer is None:
            raise ValueError(f"role {model.role!r} is frozen (no optimizer); only trainable roles can be updated")
        stats = train_epochs(worker, batch, loss_fn, config, self.generator)
        worker.version += 1
        return ModelRef(model.role, worker.version), stats


def decode_responses(tokenizer: Any, rollouts: Rollouts) -> list[str]:
    ids = rollouts.response_ids.masked_fill(~rollouts.mask, tokenizer.pad_token_id)  # [N, T]
    return tokenizer.batch_decode(ids.tolist(), skip_special_tokens=True)


def split_rows(rows: torch.Tensor, parts: int | None = None, size: int | None = None) -> list[torch.Tensor]:
    """Split `rows` into `parts` near-equal chunks, or chunks of at most `size` rows."""
    if parts is not None:
        return [chunk for chunk in torch.tensor_split(rows, parts) if len(chunk)]
    assert size is not None
    return list(torch.split(rows, size))


def train_epochs(worker: LMWorker, batch: Rollouts, loss_fn: LossFn, config: UpdateConfig,
                 generator: torch.Generator) -> dict[str, float]:
    """Epochs x mini-batches x micro-batches; returns the mean of each statistic over steps."""
    model, optimizer = worker.model, worker.optimizer
    model.train()
    wants_entropy = getattr(loss_fn, "wants_entropy", False)
    totals: dict[str, float] = {}
    steps = 0
    for _ in range(config.epochs):
        order = torch.randperm(len(batch), generator=generator) if config.shuffle else torch.arange(len(batch))
        for minibatch in split_rows(order, parts=config.minibatches):
            optimizer.zero_grad(set_to_none=True)
            step: dict[str, float] = {}
            for micro in split_rows(minibatch, size=config.micro_batch_size or len(minibatch)):
                if worker.kind == "critic":
                    output, entropy = model.values(batch.select(micro)), None  # [n, T] values, with gradients
                else:
                    output = sequence_logprobs(model, batch.select(micro), temperature=config.temperature,
                                               with_entropy=wants_entropy)
                    output, entropy = output if wants_entropy else (output, None)
                loss, metrics = loss_fn(micro, minibatch, output, entropy)
                loss.backward()
                for key, value in {"loss": loss, **metrics}.items():
                    step[key] = step.get(key, 0.0) + float(value.detach())
            clip = config.grad_clip if config.grad_clip is not None else float("inf")
            step["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
            optimizer.step()
            for key, value in step.items():
                totals[key] = totals.get(key, 0.0) + value
            steps += 1
    return {key: value / steps for key, value in totals.items()}
