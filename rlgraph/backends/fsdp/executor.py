"""The FSDP2 executor: one rank's roles in a torch.distributed job, as a compiled plan places them.

Built on every rank by `build_fsdp_executor(world, rank, plan, device)` (`rlgraph.backends.fsdp.build`;
the spmd and ray transports call it through `WorldSpec.build`). The executor is a `LocalExecutor`
whose roles are FSDP2-sharded (`rlgraph.backends.fsdp.shards`: the shard format), with
- training: gradients are summed, not averaged, across ranks: the loss is already normalised by
  the global token count (the mini-batch counts are all-reduced), so the shards' gradients add up
  to the full batch's. Mixed precision on CUDA (bf16 compute, fp32 master weights, fp32 gradient
  reduction); fp32 on CPU. Activation checkpointing when the plan's train layout says `ckpt`.
- generation in separate engines filled by `sync_weights` (`rlgraph.backends.fsdp.sync`);
- checkpoints as per-rank parts the controller merges (`rlgraph.backends.fsdp.state`);
- offload of optimizer state and gradients around generation (on CUDA).

Every rank of a group must run the group's steps together (FSDP2's all-gathers are collectives);
the plan runner sends a stage to all of a group's ranks, so they do.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from rlgraph.backends.fsdp.shards import HostBuffers, LocalShardOptimizer, RoleForward, gather_full, on_host, role_module
from rlgraph.backends.fsdp.state import ShardedState, merge_optimizer_states
from rlgraph.backends.fsdp.sync import WeightSync
from rlgraph.backends.local.state import LMWorker
from rlgraph.backends.local.executor import LocalExecutor, RewardWorker, StaleVersionError
from rlgraph.backends.local.counter_sampling import SamplingParams
from rlgraph.backends.protocols import ModelRef
from rlgraph.backends.vllm.engine import VLLMEngine
from rlgraph.batches import Rollouts

__all__ = ["FSDPExecutor", "LocalShardOptimizer", "RoleForward", "gather_full", "merge_optimizer_states", "on_host",
           "role_module"]


class FSDPExecutor(WeightSync, ShardedState, LocalExecutor):
    """A `LocalExecutor` whose trainable and reference roles are FSDP2-sharded over their group's
    ranks and whose generation runs in separate engines filled by `sync_weights`."""

    def __init__(self, models: dict[str, LMWorker], rewards: dict[str, RewardWorker], tokenizer: Any, *,
                 rank: int, device: torch.device, role_groups: dict[str, Any], shard_groups: dict[str, Any],
                 engines: dict[str, torch.nn.Module],
                 sync_groups: dict[tuple[int, ...], Any], adapters: dict[str, Any] | None = None,
                 shared_base: set[str] | None = None,
                 max_new_tokens: int = 16, seed: int = 0, envs: dict[str, Any] | None = None,
                 decode_compile: Any = "off"):
        super().__init__(models, rewards, tokenizer, max_new_tokens=max_new_tokens, seed=seed, envs=envs,
                         decode_compile=decode_compile)
        self.rank = rank
        self.device = device
        self.role_groups = role_groups    # role -> process group of all its data-parallel ranks
        self.shard_groups = shard_groups  # role -> this rank's FSDP2 shard group (the role group unless HSDP)
        self.engines = engines            # served role -> full model copy that generates
        self.served: dict[str, int] = {}  # served role -> the version its engine holds
        self.sync_groups = sync_groups    # {trainer leader} | generating ranks -> process group
        self.offloaded: dict[str, bool] = {}
        self.adapters = adapters or {}    # LoRA role -> its adapters to merge for the engine (`adapter_deltas`)
        self.shared_base = shared_base or set()  # LoRA roles whose engine runs on their whole base (`shares_base`)
        self.host_buffers: HostBuffers | None = None  # CUDA: pinned host copies of parked optimizer state, reused

    # -- generation --------------------------------------------------------------------------
    def generate(self, model: ModelRef, prompts: Any, *, n: int = 1, temperature: float = 1.0, top_p: float = 1.0,
                 max_new_tokens: int | None = None, stop: Sequence[str] = ()) -> Rollouts:
        engine = self.engines.get(model.role)
        if not isinstance(engine, VLLMEngine):
            return super().generate(model, prompts, n=n, temperature=temperature, top_p=top_p,
                                    max_new_tokens=max_new_tokens, stop=stop)
        engine.wake_up()  # a plan without offload steps never put it to sleep; one with them woke it already
        params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens or self.max_new_tokens,
                                stop=stop)
        rollouts = engine.generate(prompts, n, params, seed=self.sampling.seed, call=self.sampling.advance(temperature),
                                   model=model)
        return self.cut_at_stop(rollouts, params.stop)  # the native engine's cut, so both engines end rows alike

    def close(self) -> None:
        """End this rank's vLLM engines before the worker leaves torch.distributed (`VLLMEngine.close`)."""
        for engine in self.engines.values():
            if isinstance(engine, VLLMEngine):
                engine.close()

    def _engine(self, model: ModelRef) -> torch.nn.Module:
        if model.role not in self.engines:
            raise KeyError(f"rank {self.rank} has no generation engine for {model.role!r}; the plan generates elsewhere")
        if self.served.get(model.role) != model.version:
            held = f"{model.role}@{self.served[model.role]}" if model.role in self.served else "no weights yet"
            raise StaleVersionError(f"generate asked for {model} but rank {self.rank}'s engine serves {held}: "
                                    "a sync_weights step must load that version first")
        return self.engines[model.role]

    # -- training hooks ----------------------------------------------------------------------
    def _forward(self, worker: LMWorker, rollouts: Rollouts, *, temperature: float, with_entropy: bool,
                 packed: bool = False, vocab: bool = False):
        return worker.model(rollouts, temperature=temperature, with_entropy=with_entropy, packed=packed, vocab=vocab)

    def _all_reduce_sum(self, role: str, values: torch.Tensor) -> torch.Tensor:
        reduced = values.to(self._comm_device())
        dist.all_reduce(reduced, group=self.role_groups[role])
        return reduced.to(values.device)

    def _all_reduce_max(self, role: str, count: int) -> int:
        reduced = torch.tensor([count], device=self._comm_device())
        dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=self.role_groups[role])
        return int(reduced)

    def _grad_sync(self, worker: LMWorker, sync: bool) -> None:
        # Without sync FSDP2 accumulates the micro-batch's gradients unsharded; set on every
        # micro-batch, so an update that failed midway never leaves the next one unsynced.
        if isinstance(worker.model, FSDPModule):
            worker.model.set_requires_gradient_sync(sync)

    def _clip_grads(self, worker: LMWorker, clip: float) -> float:
        """The global gradient norm from the local shards (one all-reduce), then a local rescale:
        what `clip_grad_norm_` computes over DTensors, without a DTensor dispatch per parameter."""
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                 for p in worker.model.parameters() if p.grad is not None]
        if not grads:
            return 0.0
        # One fused kernel over the local shards (what clip_grad_norm_ runs locally), squared to add across ranks.
        norms = torch._foreach_norm([g.detach() for g in grads], 2.0)
        squares = torch.stack(norms).float().square().sum().reshape(1).to(self._comm_device())
        dist.all_reduce(squares, group=self.shard_groups[self._role_of(worker)])  # replicas hold the same shards
        norm = float(squares.sqrt())
        if math.isfinite(clip) and norm > clip:
            torch._foreach_mul_(grads, clip / (norm + 1e-6))  # the factor clip_grad_norm_ applies
        return norm

    def _comm_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    # -- memory ------------------------------------------------------------------------------
    def offload(self, role: str, direction: str) -> None:
        """Optimizer state and gradients to host memory (`offload`) or back (`onload`), through
        pinned host buffers allocated at the first offload and reused every step (`HostBuffers`).

        On a CPU device they are host memory already: the step is recorded, nothing moves.
        UNTESTED on CUDA (no GPU in the sessions that wrote it); `HostBuffers` is tested on the CPU.
        """
        self.offloaded[role] = direction == "offload"
        engine = self.engines.get(role)
        if isinstance(engine, VLLMEngine):  # the engine and the trainer's state take turns on the device
            engine.sleep() if direction == "onload" else engine.wake_up(["kv_cache"])
        worker = self.models.get(role)
        if worker is None or worker.optimizer is None or self.device.type != "cuda" or on_host(worker):
            return
        if self.host_buffers is None:
            self.host_buffers = HostBuffers(pin=True)
        for position, state in enumerate(worker.optimizer.state.values()):
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    state[key] = (self.host_buffers.park((role, position, key), value) if direction == "offload"
                                  else self.host_buffers.restore(value, self.device))
        if direction == "offload":
            for param in worker.model.parameters():
                param.grad = None
        torch.cuda.synchronize(self.device)

