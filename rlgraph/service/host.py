"""Where the tenants live: their adapters, AdamW states and executors over one base model.

`TenantHost` holds them and answers the service's tenant commands (`COMMANDS`). The local server
keeps one host in its own process and calls it directly; `rlgraph serve --runtime spmd` starts
one per rank (`ServiceWorld.build`), each over its FSDP2 shard of the base, and the server sends
every command to every rank through the transport (`transport.command`, `service/ranks.py`), so
a tenant's adapter lives on every rank that holds the base. Between commands the plan runner runs
the call's plan on the host: the host is the rank's executor, standing in for its active tenant's
(`use` picks it).

    host.create("t1", LoraSpec(rank=8), max_new_tokens=16)
    host.use("t1", keep="grads")        # the tenant's executor runs the next plan; its gradients kept
    programs.run(plan, host, rollouts)  # (on ranks: PlanRunner over the transport)
    host.done(undo=False)

On a rank, the base's decoder layers and root are FSDP2-sharded (`fully_shard`, as the training
executor shards a role) and the adapters peft adds afterwards are whole on every rank (an
adapter is small): their gradients are summed across the ranks before the optimizer step, so
every rank steps the same adapter. Samplers generate from a whole copy of the base on each rank
(`engine`), as the FSDP2 executor's separate generation engines do.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from rlgraph.backends.local.state import LMWorker
from rlgraph.backends.local.counter_sampling import SamplingStream
from rlgraph.service.tenants import BaseModel, LoraSpec, TenantExecutor

COMMANDS = ("create", "drop", "tensors", "state", "load", "add_sampler", "use", "bad_values", "done")
# Tinker's AdamParams defaults; `optim_step` sets each call's own values on the optimizer.
ADAM = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)


class TenantHost:
    """Every tenant's and sampler's executor over `base` (training) and `engine` (sampling; the
    same model in one process). Adapter names key them; a base sampler has a key of its own (in `bare`)."""

    commands = COMMANDS  # what `Worker.executor_command` may call

    def __init__(self, base: BaseModel, engine: BaseModel | None = None):
        self.base = base
        self.engine = engine or base
        self.executors: dict[str, TenantExecutor] = {}
        self.bare: set[str] = set()  # the keys of base samplers (every adapter off)
        self.active: str | None = None
        self._saved: dict[str, Any] = {}  # what `use` kept for `done` (undo, the sampling stream)

    @property
    def device(self) -> torch.device:
        return self.base.device

    def __getattr__(self, name: str) -> Any:
        # The plan runner and the rank's worker see the host as an executor: the active tenant's.
        executors = self.__dict__.get("executors", {})
        if name.startswith("_") or self.__dict__.get("active") not in executors:
            raise AttributeError(f"TenantHost.{name}: no tenant's executor is active")
        return getattr(executors[self.__dict__["active"]], name)

    def close(self) -> None:
        """Release what the host made outside its models (nothing here; the vLLM host's adapter folder)."""

    # -- commands ----------------------------------------------------------------------------------
    def create(self, adapter: str, lora: LoraSpec, max_new_tokens: int) -> None:
        """A training tenant: a fresh adapter, its AdamW (Tinker's defaults) and its executor."""
        params = self.base.add_adapter(adapter, lora)
        # Not make_optimizer: it keeps only parameters that require grad, and an inactive peft adapter's do not.
        optimizer = torch.optim.AdamW(params, **ADAM)
        self.executors[adapter] = self.base.executor(params, optimizer, seed=lora.seed, max_new_tokens=max_new_tokens)

    def add_sampler(self, key: str, lora: LoraSpec | None, tensors: Mapping[str, torch.Tensor] | None,
                    where: str, max_new_tokens: int) -> None:
        """A sampler on a new adapter `key` holding `tensors` (all or nothing), or (`lora` None) on the bare base."""
        if lora is None:
            self.bare.add(key)
        else:
            self.engine.add_adapter(key, lora)
            try:
                self.engine.load_adapter_state(key, tensors, where)
            except BaseException:
                self.engine.delete_adapter(key)
                raise
        self.executors[key] = self.sampler_executor(key, lora, max_new_tokens)

    def sampler_executor(self, key: str, lora: LoraSpec | None, max_new_tokens: int) -> Any:
        """The executor that samples for `key` (its adapter, or the bare base, already set up)."""
        return self.engine.executor([], None, seed=lora.seed if lora else 0, max_new_tokens=max_new_tokens)

    def drop(self, key: str) -> None:
        executor = self.executors.pop(key, None)
        if key in self.bare:
            self.bare.discard(key)
        elif executor is not None:
            (self.base if executor.params else self.engine).delete_adapter(key)

    def tensors(self, adapter: str) -> dict[str, torch.Tensor]:
        return self.base.adapter_state(adapter)

    def state(self, adapter: str) -> dict[str, Any]:
        """What save_state keeps of a tenant: adapter, AdamW state, sampling stream."""
        executor = self.executors[adapter]
        return {"adapter": self.tensors(adapter), "optimizer": executor.models["policy"].optimizer.state_dict(),
                "sampling": attrs.asdict(executor.sampling)}

    def load(self, adapter: str, tensors: Mapping[str, torch.Tensor], where: str,
             optimizer: Mapping[str, Any] | None, sampling: Mapping[str, Any] | None) -> None:
        """The saved adapter into `adapter` (pending gradients dropped); with `optimizer`, the AdamW state
        and sampling stream too, else a fresh AdamW state."""
        executor = self.executors[adapter]
        self.base.load_adapter_state(adapter, tensors, where)
        for param in executor.params:
            param.grad = None
        if optimizer is not None:
            executor.models["policy"].optimizer.load_state_dict(optimizer)
            executor.sampling = SamplingStream(**sampling)
        else:
            executor.models["policy"].optimizer.state.clear()

    def use(self, key: str, *, keep: str | None = None, seed: int | None = None) -> None:
        """The next plans run `key`'s executor with only its adapter on (a base sampler: none).
        `keep`: "grads" (a forward_backward) or "all" (an optim_step), what `done(undo=True)` puts back;
        `seed`: a seeded sample, which leaves the sampler's own stream where it was."""
        executor = self.executors[key]
        module = (self.base if executor.params else self.engine).module
        if hasattr(module, "base_model"):  # a PeftModel: some adapter exists
            if key in self.bare:
                module.base_model.disable_adapter_layers()
            else:
                module.base_model.enable_adapter_layers()
                module.set_adapter(key)  # also: only this adapter requires grad
        self.active = key
        self._saved = {"keep": keep, "stream": executor.sampling}
        if keep is not None:
            self._saved["undo"] = undo_point(executor, with_weights=keep == "all")
        if seed is not None:
            executor.sampling = SamplingStream(int(seed))

    def bad_values(self) -> int:
        """How many of the active adapter's values are non-finite (after a step)."""
        return sum(int((~torch.isfinite(param)).sum()) for param in self.executors[self.active].params)

    def done(self, undo: bool = False) -> None:
        """End what `use` began: the sampling stream back; with `undo`, what `use` kept put back."""
        executor = self.executors[self.active]
        executor.sampling = self._saved.get("stream", executor.sampling)
        if undo and "undo" in self._saved:
            restore(executor, self._saved["undo"])
        self._saved = {}
        if self.active in self.bare and hasattr(self.engine.module, "base_model"):
            self.engine.module.base_model.enable_adapter_layers()


def undo_point(executor: TenantExecutor, *, with_weights: bool) -> dict[str, Any]:
    """The gradients (and, `with_weights`, the values and the optimizer state) to undo a call."""
    params = executor.params
    point: dict[str, Any] = {"grads": [None if p.grad is None else p.grad.clone() for p in params]}
    if with_weights:
        point["values"] = [p.detach().clone() for p in params]
        point["optimizer"] = copy.deepcopy(executor.models["policy"].optimizer.state_dict())
    return point


def restore(executor: TenantExecutor, point: Mapping[str, Any]) -> None:
    params = executor.params
    if "values" in point:
        with torch.no_grad():
            for param, value in zip(params, point["values"]):
                param.copy_(value)
        executor.models["policy"].optimizer.load_state_dict(point["optimizer"])
    for param, grad in zip(params, point["grads"]):
        param.grad = grad


# -- on the ranks of `rlgraph serve --runtime spmd` ------------------------------------------------------


class RankTenantExecutor(TenantExecutor):
    """A tenant's executor on one rank: the base FSDP2-sharded (its root a `RoleForward`), the
    adapter whole; batch counts and gradients summed over the ranks, as the FSDP2 executor sums them."""

    def _forward(self, worker: LMWorker, rollouts: Any, *, temperature: float, with_entropy: bool,
                 packed: bool = False, vocab: bool = False):
        return worker.model(rollouts, temperature=temperature, with_entropy=with_entropy, packed=packed, vocab=vocab)

    def _all_reduce_sum(self, role: str, values: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        reduced = values.clone()
        dist.all_reduce(reduced)
        return reduced

    def _all_reduce_max(self, role: str, count: int) -> int:
        import torch.distributed as dist

        reduced = torch.tensor([count])
        dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
        return int(reduced)

    def optimizer_step(self, model: Any, **settings: Any) -> Any:
        # Each rank holds the gradient of its rows; the loss is normalised by the global counts, so
        # the sum is the whole batch's gradient (the same on every rank, hence the same step).
        import torch.distributed as dist

        for param in self.params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad)
        return super().optimizer_step(model, **settings)


class ShardedBase(BaseModel):
    """A `BaseModel` whose decoder layers and root are FSDP2-sharded over the job's ranks."""

    def shard(self) -> ShardedBase:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from rlgraph.backends.fsdp.shards import RoleForward, decoder_layers

        mesh = init_device_mesh(self.device.type, (torch.distributed.get_world_size(),))
        self.root = RoleForward(self.module, "policy")  # the root forward FSDP2 sees (embeddings, head)
        for layer in decoder_layers(self.module):
            fully_shard(layer, mesh=mesh)
        fully_shard(self.root, mesh=mesh)
        return self

    def executor(self, params: list[torch.nn.Parameter], optimizer: Any, *, seed: int,
                 max_new_tokens: int) -> TenantExecutor:
        worker = LMWorker(self.root, optimizer)
        return RankTenantExecutor({"policy": worker}, {}, self.tokenizer, max_new_tokens=max_new_tokens, seed=seed,
                                  params=params, device=self.device)


@attrs.frozen
class ServiceWorld:
    """The recipe each rank builds its `TenantHost` from (pickled to the workers): the base model's
    source and seed. `rewards` is the field every worker recipe has (the service scores nothing)."""

    model: str
    seed: int = 0
    rewards: Mapping[str, Any] = attrs.field(factory=dict)

    def build(self, rank: int, plan: Any, device: torch.device) -> TenantHost:
        base = ShardedBase.build(self.model, seed=self.seed, device=device.type).shard()
        return TenantHost(base, BaseModel.build(self.model, seed=self.seed, device=device.type))
