"""The training epochs of `rg.update`: epochs x mini-batches x micro-batches of the loss closure,
gradient accumulation, global-norm clipping, one optimizer step per mini-batch, and the refusal of a
non-finite step. A mixin of the local executor (`TrainingEpochs`): the data-parallel hooks
(`_all_reduce_sum`, `_all_reduce_max`, `_grad_sync`, `_clip_grads`) are a single process's here
and are overridden by the FSDP2 executor and the service's tenant hosts, whose ranks hold shards.
"""

from __future__ import annotations

import math

import torch

from rlgraph.backends.local.state import LMWorker
from rlgraph.backends.protocols import LossCounts, LossFn, UpdateConfig
from rlgraph.batches import Rollouts
from rlgraph.errors import RLGraphError
from rlgraph.functional.aggregate import global_counts


class NonFiniteUpdate(RLGraphError):
    """An update's gradient norm was NaN or inf; no weight was changed by that mini-batch."""


class TrainingEpochs:
    """`_train_epochs` and the hooks it calls; the executor supplies `_micro_batches`,
    `_compiled_forward`, `_autocast`, `_role_of` and its shuffle `generator`."""

    def _all_reduce_sum(self, role: str, values: torch.Tensor) -> torch.Tensor:
        """Sum over the role's data-parallel ranks; one process holds every row."""
        return values

    def _all_reduce_max(self, role: str, count: int) -> int:
        """The largest `count` over the role's data-parallel ranks; one process: `count`."""
        return count

    def _grad_sync(self, worker: LMWorker, sync: bool) -> None:
        """Before a micro-batch's backward: whether its gradients are reduced across ranks now
        (every micro-batch, or only the last under `grad_sync_last`); one process has nothing to reduce."""

    def _clip_grads(self, worker: LMWorker, clip: float) -> float:
        """Clip to the global norm `clip` (inf: measure only); returns the norm before clipping."""
        return float(torch.nn.utils.clip_grad_norm_(worker.model.parameters(), clip))

    def _train_epochs(self, worker: LMWorker, batch: Rollouts, loss_fn: LossFn, config: UpdateConfig,
                      kept: torch.Tensor | None = None) -> dict[str, float]:
        """Epochs x mini-batches x micro-batches; returns the mean of each statistic over optimizer steps.

        Each mini-batch's token and sequence counts, and each step's statistics, are summed over
        the data-parallel ranks (`_all_reduce_sum`), so N ranks holding N shards compute the loss,
        gradients and statistics of the whole batch. `config.step=False` only adds gradients
        (no zero_grad, no step); `kept` [N, T] receives each row's per-token output.
        """
        role, optimizer = self._role_of(worker), worker.optimizer
        set_mode(worker.model, training=True)
        wants_entropy = getattr(loss_fn, "wants_entropy", False)
        packed = config.micro_batch_tokens is not None
        # rows in order and split in order: a (mini/micro-)batch of every row is `batch` itself, not a copy
        in_order = not config.shuffle and not packed
        totals: dict[str, float] = {}
        steps = 0
        skipped = 0
        for epoch in range(config.epochs):
            order = torch.randperm(len(batch), generator=self.generator) if config.shuffle else torch.arange(len(batch))
            for index, minibatch in enumerate(split_rows(order, parts=config.minibatches)):
                if config.step:
                    optimizer.zero_grad(set_to_none=True)
                whole = in_order and len(minibatch) == len(batch)
                mask = batch.mask if whole else batch.mask[minibatch.to(batch.mask.device)]
                counts = self._all_reduce_sum(role, torch.stack(global_counts(mask)))
                step: dict[str, torch.Tensor] = {}
                micros, real = self._micro_batches(worker, batch, minibatch, config.micro_batch_tokens,
                                                   f"rg.update({role})", size=config.micro_batch_size)
                finite: list[torch.Tensor] = []  # per micro-batch, on the device: read only if the step fails
                for position, micro in enumerate(micros):
                    with self._autocast():  # the forward only: the loss math and backward stay out of autocast
                        rows = batch if in_order and len(micro) == len(batch) else batch.select(micro)
                        output, entropy = self._compiled_forward(worker, rows,
                                                                 temperature=config.temperature,
                                                                 with_entropy=wants_entropy, packed=packed,
                                                                 vocab=config.vocab)
                    if position >= real:  # a filler: no loss; its backward keeps the ranks' collectives in step
                        self._grad_sync(worker, position == len(micros) - 1 or not config.grad_sync_last)
                        (output.sum() * 0.0).backward()
                        finite.append(torch.ones((), dtype=torch.bool, device=output.device))
                        continue
                    loss, metrics = loss_fn(micro, LossCounts(counts[0], counts[1]), output, entropy)
                    if kept is not None:
                        kept[micro.to(kept.device)] = output.detach()
                    finite.append(torch.isfinite(loss.detach()))
                    self._grad_sync(worker, position == len(micros) - 1 or not config.grad_sync_last)
                    loss.backward()
                    for key, value in {"loss": loss, **metrics}.items():
                        step[key] = step.get(key, 0.0) + value.detach().double()
                # The statistics are summed over ranks where they are; one copy to the host after the step.
                summed = self._all_reduce_sum(role, torch.stack(list(step.values()))) if step else torch.zeros(0)
                clip = config.grad_clip if config.grad_clip is not None else float("inf")
                # The step's one host sync: the global norm decides, on every rank alike, whether to step.
                grad_norm = self._clip_grads(worker, clip)
                if not math.isfinite(grad_norm):
                    if config.step:  # an accumulating update leaves the gradients to its caller
                        optimizer.zero_grad(set_to_none=True)  # nothing non-finite reaches the weights
                    bad_rows = [row for micro, ok in zip(micros, torch.stack(finite).tolist()) if not ok for row in micro.tolist()]
                    self._refuse_nonfinite(role, worker, config, grad_norm, epoch, index, bad_rows)
                    skipped += 1
                    continue
                if config.step:
                    optimizer.step()
                for key, value in zip(step, summed.tolist()):
                    totals[key] = totals.get(key, 0.0) + value
                totals["grad_norm"] = totals.get("grad_norm", 0.0) + grad_norm
                steps += 1
        if not steps:  # every mini-batch was skipped: the statistics of no step
            totals = {key: float("nan") for key in [*step, "grad_norm"]}
        stats = {key: value / max(steps, 1) for key, value in totals.items()}
        return {**stats, "skipped_steps": float(skipped)} if config.on_nonfinite == "skip" else stats

    def _refuse_nonfinite(self, role: str, worker: LMWorker, config: UpdateConfig, grad_norm: float, epoch: int,
                          minibatch: int, bad_rows: list[int]) -> None:
        """With `on_nonfinite="raise"`: stop, saying where, before the optimizer step."""
        if config.on_nonfinite == "skip":
            return
        rows = f"rows with a non-finite loss here: {bad_rows[:8]}" if bad_rows else "every loss was finite: the gradient overflowed"
        raise NonFiniteUpdate(
            f"update of {role}@{worker.version}: the gradient norm is {grad_norm} at epoch {epoch}, mini-batch "
            f"{minibatch}; this mini-batch changed no weight ({rows})\n  fix: find where the NaN/inf enters (a reward, "
            "an advantage, a log-ratio: this step's metrics show it), or pass on_nonfinite='skip' to rg.update to "
            "drop such mini-batches and count them")


def set_mode(module: torch.nn.Module, *, training: bool) -> None:
    """`module.train(training)`, unless every submodule is in that mode already: the walk sets the
    flag on each module through `nn.Module.__setattr__` (0.1-0.3 ms on the bench's 2-layer model, a
    few times a step); reading the flags costs a tenth of that."""
    if any(sub.training != training for sub in module.modules()):
        module.train(training)


def split_rows(rows: torch.Tensor, parts: int | None = None, size: int | None = None) -> list[torch.Tensor]:
    """Split `rows` into `parts` near-equal chunks, or chunks of at most `size` rows."""
    if parts is not None:
        return [chunk for chunk in torch.tensor_split(rows, parts) if len(chunk)]
    assert size is not None
    return list(torch.split(rows, size))
