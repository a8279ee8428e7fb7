"""What a run's roles are made of, as plain picklable data: the recipe every rank builds its executor from.

    world = WorldSpec(roles={"policy": RoleSpec(optimizer="adamw", lr=1e-4)}, rewards={"reward": exact_match})
    executor = world.build_local(device)           # every role in this process, on `device`
    executor = world.build(rank, plan, device)     # rank `rank` of a compiled plan: FSDP2 roles, engines

A worker process receives the `WorldSpec` (not live models) and builds only the roles the plan
places on its rank; the controller keeps the reward functions (`world.controller()`). `weights`
carries a state dict (e.g. a warm-started policy) so every rank starts from the same parameters;
`source` is anything `build_causal_lm` takes (None: the shipped tiny Qwen2, a config, or a local
Hugging Face directory, loaded by each rank itself).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch

OPTIMIZERS = ("sgd", "adamw")
KINDS = ("lm", "critic")


def _one_of(choices: tuple[str, ...]):
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is not None and value not in choices:
            raise ValueError(f"RoleSpec.{attribute.name} must be one of {', '.join(choices)}, got {value!r}")
    return check


@attrs.frozen
class RoleSpec:
    """One model role. `optimizer=None` makes it frozen (a reference model)."""

    source: Any = None
    weights: Mapping[str, torch.Tensor] | None = attrs.field(default=None, eq=False, repr=False)
    kind: str = attrs.field(default="lm", validator=_one_of(KINDS))
    optimizer: str | None = attrs.field(default=None, validator=_one_of(OPTIMIZERS))
    lr: float = 1e-4
    seed: int = 0

    def build_module(self, tokenizer: Any, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        from rlgraph.backends.local.critic import build_critic
        from rlgraph.backends.local.models import build_causal_lm

        if self.kind == "critic":
            module = build_critic(self.source, tokenizer=tokenizer, seed=self.seed, dtype=dtype)
        else:
            module = build_causal_lm(self.source, tokenizer=tokenizer, seed=self.seed, dtype=dtype)
        if self.weights is not None:
            module.load_state_dict(dict(self.weights), strict=True)
        if self.optimizer is None:
            module.requires_grad_(False)
        return module

    def build_optimizer(self, parameters: Any) -> torch.optim.Optimizer | None:
        if self.optimizer == "sgd":
            return torch.optim.SGD(parameters, lr=self.lr)
        if self.optimizer == "adamw":
            return torch.optim.AdamW(parameters, lr=self.lr)
        return None


@attrs.frozen
class WorldSpec:
    roles: Mapping[str, RoleSpec]
    rewards: Mapping[str, Callable[..., Any]] = attrs.field(factory=dict)
    tokenizer: str | None = None  # a directory; None: the shipped character tokenizer
    max_new_tokens: int = 16
    seed: int = 0
    fsdp_unit_params: int = 1_000_000  # a decoder layer with at least this many parameters is its own FSDP2 unit

    @classmethod
    def of_executor(cls, executor: Any, rewards: Mapping[str, Callable[..., Any]], *, source: Any = None,
                    tokenizer: str | None = None, max_new_tokens: int = 16, seed: int = 0) -> WorldSpec:
        """A local executor's roles as a recipe worker processes rebuild them from: each role's
        current weights (a CPU copy, whatever the device), its optimizer kind and learning rate
        (a fresh optimizer state), built from `source` (a model directory or config; None: the tiny Qwen2)."""
        roles = {}
        for role, worker in executor.models.items():
            optimizer = worker.optimizer
            kind = None if optimizer is None else ("sgd" if isinstance(optimizer, torch.optim.SGD) else "adamw")
            roles[role] = RoleSpec(source=source, kind=worker.kind, optimizer=kind,
                                   lr=optimizer.param_groups[0]["lr"] if optimizer is not None else 0.0,
                                   weights={k: v.detach().to("cpu", copy=True) for k, v in worker.model.state_dict().items()})
        return cls(roles, dict(rewards), tokenizer=tokenizer, max_new_tokens=max_new_tokens, seed=seed)

    def load_tokenizer(self) -> Any:
        from rlgraph.backends.local.models import load_tokenizer

        return load_tokenizer(self.tokenizer)

    def build_local(self, device: torch.device | str = "cpu") -> Any:
        """Every role in this process: the local executor, its models on `device` (fp32 weights;
        on CUDA it computes in bf16 autocast)."""
        from rlgraph.backends.local.executor import LMWorker, LocalExecutor, RewardWorker, require_device

        device = require_device(device)
        tokenizer = self.load_tokenizer()
        models = {}
        for role, spec in self.roles.items():
            module = spec.build_module(tokenizer).to(device)  # built on the CPU: the same weights on any device
            models[role] = LMWorker(module, spec.build_optimizer(module.parameters()), kind=spec.kind)
        return LocalExecutor(models, {name: RewardWorker(fn) for name, fn in self.rewards.items()}, tokenizer,
                             max_new_tokens=self.max_new_tokens, seed=self.seed, device=device)

    def controller(self) -> Any:
        """The controller's executor: reward functions and the tokenizer, no models."""
        from rlgraph.backends.local.executor import LocalExecutor, RewardWorker

        return LocalExecutor({}, {name: RewardWorker(fn) for name, fn in self.rewards.items()}, self.load_tokenizer(),
                             max_new_tokens=self.max_new_tokens, seed=self.seed)

    def build(self, rank: int, plan: Any, device: torch.device) -> Any:
        """Rank `rank`'s executor for `plan` (inside a torch.distributed job): see `rlgraph.backends.fsdp`."""
        from rlgraph.backends.fsdp.executor import build_fsdp_executor

        return build_fsdp_executor(self, rank, plan, device)
