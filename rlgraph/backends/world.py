"""What a run's roles are made of, as plain picklable data: the recipe every rank builds its executor from.

    world = WorldSpec(roles={"policy": RoleSpec(optimizer="adamw", lr=1e-4)}, rewards={"reward": exact_match})
    executor = world.build_local(device)           # every role in this process, on `device`
    workers = world.build_workers(device, tokenizer, given={"policy": live})   # the roles alone (an executor's own)
    executor = world.build(rank, plan, device)     # rank `rank` of a compiled plan: FSDP2 roles, engines
    state = world.merge_states(parts)              # the ranks' checkpoint parts as one full state

A worker process receives the `WorldSpec` (not live models) and builds only the roles the plan
places on its rank; the controller keeps the reward functions (`world.controller()`). `weights_file`
names a safetensors file of the role's weights (e.g. a warm-started policy; `of_executor(weights_dir=...)`
writes them) so every rank starts from the same parameters, and an FSDP2 rank reads only its shard
of it; `weights` carries the state dict itself (small models, tests: it is pickled to every worker);
`source` is anything `build_causal_lm` takes (None: the shipped tiny Qwen2, a config, or a local
Hugging Face directory, loaded by each rank itself).

LoRA: `RoleSpec(lora={"r": 8, ...})` (the `LoraSettings` fields) builds the model, then peft
adapters seeded with `seed` (so every rank builds the same ones); only the adapters train. Its
`weights` are the peft model's whole state dict (base under peft's `base_layer` names, and the
adapters: what `of_executor` sends), or a plain model's (the base; fresh seeded adapters on top).
`RoleSpec(base_of="policy")` is a role with no weights of its own: that role's module with its
adapters off (a LoRA policy's KL reference); it must be placed on that role's ranks.

A critic (`kind="critic"`) given a language model's weights (no `backbone.` names: the policy's)
takes them as its backbone, its value head drawn with `seed`; `backbone_seed` draws a backbone
built from a config with that seed (the policy's), so a critic starts from the policy's weights
without them being written anywhere.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
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


def _lm_only(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and instance.kind != "lm":
        raise ValueError(f"RoleSpec.{attribute.name} is for a language model role, not a {instance.kind!r} one")


def _critic_only(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and instance.kind != "critic":
        raise ValueError(f"RoleSpec.{attribute.name} is for a critic role, not a {instance.kind!r} one")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"RoleSpec.{attribute.name} must be an int seed, got {value!r}")


# The optimizer hyper-parameters `of_executor` carries over (besides the learning rate).
OPTIMIZER_OPTIONS = ("betas", "eps", "weight_decay", "amsgrad", "momentum", "dampening", "nesterov", "fused")


@attrs.frozen
class RoleSpec:
    """One model role. `optimizer=None` makes it frozen (a reference model); `optimizer_options`
    are its other keyword arguments (`weight_decay`, `betas`, ...; default: torch's)."""

    source: Any = None
    weights: Mapping[str, torch.Tensor] | None = attrs.field(default=None, eq=False, repr=False)
    weights_file: str | None = None  # a safetensors file (`write_weights`) instead of `weights`
    kind: str = attrs.field(default="lm", validator=_one_of(KINDS))
    optimizer: str | None = attrs.field(default=None, validator=_one_of(OPTIMIZERS))
    lr: float = 1e-4
    seed: int = 0
    optimizer_options: Mapping[str, Any] = attrs.field(factory=dict, hash=False)
    lora: Mapping[str, Any] | None = attrs.field(default=None, validator=_lm_only, hash=False)  # the LoraSettings fields
    base_of: str | None = attrs.field(default=None, validator=_lm_only)  # another role's module, adapters off
    # A critic's backbone drawn with this seed (the policy's: it starts from the policy's weights)
    backbone_seed: int | None = attrs.field(default=None, validator=_critic_only)
    train_vision: bool = False  # a Qwen2-VL / Qwen2.5-VL's vision tower trains too (frozen by default)

    def weight_source(self) -> Any:
        """The role's start-up weights, read on demand (`WeightSource`), or None: built from `source`."""
        from rlgraph.backends.fsdp.loading import WeightSource

        if self.weights_file is not None:
            return WeightSource.of(self.weights_file)
        return WeightSource.of(self.weights) if self.weights is not None else None

    def build_module(self, tokenizer: Any, dtype: torch.dtype = torch.float32, *, merged: bool = False,
                     empty: bool = False) -> torch.nn.Module:
        """The role's model (with `lora`: the peft model, only its adapters trainable); `merged=True`
        gives a LoRA role as the plain model with its adapters merged in (what a generator serves).
        `empty=True` skips reading weights (and, like any build given weights, the checkpoint in
        `source`: its config only): for a build under `parameters_on_meta`, whose parameters a rank
        fills from `weight_source()`."""
        from rlgraph.backends.local.critic import build_critic
        from rlgraph.backends.local.models import config_only
        from rlgraph.backends.local.vlm import build_language_model

        assert self.base_of is None, "a view of another role builds nothing of its own"
        weights = None if empty else self.weight_source()
        weights = None if weights is None else weights.state_dict()
        # Weights given: a checkpoint in `source` would be read only to be overwritten; its config suffices.
        source = config_only(self.source) if empty or weights is not None else self.source
        if self.lora is not None:
            module = self._build_lora(source, weights, tokenizer, dtype, merged)
        elif self.kind == "critic":
            module = build_critic(source, tokenizer=tokenizer, seed=self.seed, backbone_seed=self.backbone_seed, dtype=dtype)
        else:  # a causal LM, or a Qwen2-VL / Qwen2.5-VL (its vision tower frozen)
            module = build_language_model(source, tokenizer=tokenizer, seed=self.seed, dtype=dtype,
                                          train_vision=self.train_vision)
        if weights is not None and self.kind == "critic" and not any(name.startswith("backbone.") for name in weights):
            module.backbone.load_state_dict(weights, strict=True)  # a language model's weights: the critic's backbone
        elif weights is not None and self.lora is None:
            module.load_state_dict(weights, strict=True)
        if self.optimizer is None:
            module.requires_grad_(False)
        return module

    def _build_lora(self, source: Any, weights: dict[str, torch.Tensor] | None, tokenizer: Any, dtype: torch.dtype,
                    merged: bool) -> torch.nn.Module:
        """The base (its weights: `weights` when they are a plain model's), then seeded adapters (their
        weights: `weights` when they are a peft model's); merged: a plain model of the merged weights."""
        from rlgraph.backends.local.state import is_adapter_set
        from rlgraph.backends.local.vlm import build_language_model
        from rlgraph.backends.lora import LoraSettings, apply_lora, merged_state_dict  # the one LoRA builder

        # fp32: the adapters train in it; a VLM's tower is frozen with the rest of the base (peft)
        module = build_language_model(source, tokenizer=tokenizer, seed=self.seed)
        peft_weights = weights is not None and is_adapter_set(weights)
        if weights is not None and not peft_weights:
            module.load_state_dict(weights, strict=True)
        module = apply_lora(module, LoraSettings(**self.lora), seed=self.seed)
        if peft_weights:
            module.load_state_dict(weights, strict=True)
        if not merged:
            return module.to(dtype)
        plain = build_language_model(source, tokenizer=tokenizer, seed=self.seed, dtype=dtype)
        plain.load_state_dict(merged_state_dict(module), strict=True)
        return plain

    def build_lora_on_meta(self, tokenizer: Any) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
        """A LoRA role's peft model with every parameter on the meta device, and its adapters as
        `build_module` draws them (the same seed, so the same values as the full build's), full
        tensors under the peft model's names: what a rank fills its shards from, besides the base's
        files. The base is never materialised: peft puts new adapters on their base weight's device,
        so each target weight is, while peft wraps it, a one-element CPU placeholder of its shape."""
        from rlgraph.backends.fsdp.loading import parameters_on_meta
        from rlgraph.backends.local.models import build_causal_lm, config_only
        from rlgraph.backends.lora import LoraSettings, apply_lora, trainable_state

        settings = LoraSettings(**self.lora)
        with parameters_on_meta():
            base = build_causal_lm(config_only(self.source), tokenizer=tokenizer, seed=self.seed)
        targets = [module for name, module in base.named_modules() if isinstance(module, torch.nn.Linear)
                   and any(name == t or name.endswith("." + t) for t in settings.target_modules)]
        held = [module.weight for module in targets]
        for module in targets:  # stride 0: one element of storage, whatever the shape
            module.weight = torch.nn.Parameter(torch.zeros(1).expand(module.weight.shape), requires_grad=False)
        module = apply_lora(base, settings, seed=self.seed)  # peft wraps the same Linear objects
        for linear, weight in zip(targets, held, strict=True):
            linear.weight = weight.requires_grad_(False)  # frozen, as peft froze the placeholder
        adapters = {name: tensor.clone() for name, tensor in trainable_state(module).items()}
        for owner in module.modules():  # the adapters to the meta device too: the rank fills its rows of them
            for key, param in owner._parameters.items():
                if param is not None and param.device.type != "meta":
                    owner._parameters[key] = torch.nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        if self.optimizer is None:
            module.requires_grad_(False)
        return module, adapters

    def build_optimizer(self, parameters: Any) -> torch.optim.Optimizer | None:
        """Over the parameters that require grad (LoRA: the adapters); None for a frozen role."""
        return None if self.optimizer is None else make_optimizer(self.optimizer, parameters, self.lr, **self.optimizer_options)


def make_optimizer(name: str, parameters: Any, lr: float, **options: Any) -> torch.optim.Optimizer:
    """The one optimizer factory of every runtime and entry point (`rlgraph train`, the demo, the
    bench, the workers' `RoleSpec`, `rlgraph.testing`): `name` "sgd" or "adamw" over the parameters
    that require grad (LoRA: the adapters), `options` its keyword arguments. AdamW is the fused
    kernel (one call for every tensor; what the memory model assumes) where torch has it for the
    parameters, unless `fused` is given."""
    params = [p for p in parameters if p.requires_grad]
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, **options)
    if name == "adamw":
        options.setdefault("fused", all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params) or None)
        return torch.optim.AdamW(params, lr=lr, **options)
    raise ValueError(f"optimizer must be 'sgd' or 'adamw', got {name!r}")


@attrs.frozen
class WorldSpec:
    roles: Mapping[str, RoleSpec]
    rewards: Mapping[str, Callable[..., Any]] = attrs.field(factory=dict)
    tokenizer: str | None = None  # a directory; None: the shipped character tokenizer
    vision_tokens: bool = False  # add Qwen2-VL's three vision tokens to it (a vision run's tokenizer, `build_vl_tokenizer`)
    max_new_tokens: int = 16
    seed: int = 0
    fsdp_unit_params: int = 1_000_000  # a decoder layer with at least this many parameters is its own FSDP2 unit
    # env role -> a picklable recipe (a class, a functools.partial): each rank that runs rg.rollout
    # builds its environments from it, in its own process, beside the generation engine
    envs: Mapping[str, Callable[[], Any]] = attrs.field(factory=dict)
    # `generation.compile` for the ranks that generate with the native engine: a `DecodeCompile`, or a
    # mode ("auto", "on", "off"; True/False for on/off), checked here, before any worker starts
    decode_compile: Any = attrs.field(default="off", converter=lambda value: _decode_policy(value))

    @classmethod
    def of_executor(cls, executor: Any, rewards: Mapping[str, Callable[..., Any]], *, source: Any = None,
                    tokenizer: str | None = None, max_new_tokens: int = 16, seed: int = 0,
                    weights_dir: str | os.PathLike | None = None) -> WorldSpec:
        """A local executor's roles as a recipe worker processes rebuild them from: each role's
        current weights, its optimizer kind, learning rate and hyper-parameters (a fresh optimizer
        state), built from `source` (a model directory or config; None: the tiny Qwen2). A LoRA role
        carries its settings (and its peft state dict); a LoRA policy's reference view becomes
        `RoleSpec(base_of=...)`. With `weights_dir` each role's weights are written once to
        `<weights_dir>/<role>.safetensors` and the spec carries only the path (what a real model
        needs: the spec is pickled to every worker); without, a CPU copy of them (small models)."""
        lora, views = _lora_roles(executor.models)
        roles = {}
        for role, worker in executor.models.items():
            if role in views:
                roles[role] = RoleSpec(source=source, base_of=views[role])
                continue
            optimizer = worker.optimizer
            kind = None if optimizer is None else ("sgd" if isinstance(optimizer, torch.optim.SGD) else "adamw")
            group = optimizer.param_groups[0] if optimizer is not None else {}
            state = worker.model.state_dict()
            if weights_dir is not None:
                from rlgraph.backends.fsdp.loading import write_weights

                carried = {"weights_file": str(write_weights(state, Path(weights_dir).resolve() / f"{role}.safetensors"))}
            else:
                carried = {"weights": {k: v.detach().to("cpu", copy=True) for k, v in state.items()}}
            roles[role] = RoleSpec(source=source, kind=worker.kind, optimizer=kind, lr=group.get("lr", 0.0),
                                   optimizer_options={key: group[key] for key in OPTIMIZER_OPTIONS if key in group},
                                   lora=lora.get(role), **carried)
        return cls(roles, dict(rewards), tokenizer=tokenizer, max_new_tokens=max_new_tokens, seed=seed,
                   envs=dict(getattr(executor, "envs", {})))

    def load_tokenizer(self) -> Any:
        """The run's tokenizer, rebuilt in each process from plain data: with `vision_tokens`, the same
        ids the controller's vision tokenizer gives (they are appended in a fixed order)."""
        from rlgraph.backends.local.models import load_tokenizer
        from rlgraph.backends.local.vlm import build_vl_tokenizer

        return build_vl_tokenizer(self.tokenizer) if self.vision_tokens else load_tokenizer(self.tokenizer)

    def build_local(self, device: torch.device | str = "cpu") -> Any:
        """Every role in this process: the local executor, its models on `device` (fp32 weights;
        on CUDA it computes in bf16 autocast)."""
        from rlgraph.backends.local.executor import LocalExecutor, RewardWorker, require_device

        device = require_device(device)
        tokenizer = self.load_tokenizer()
        rewards = {name: RewardWorker(fn) for name, fn in self.rewards.items()}
        return LocalExecutor(self.build_workers(device, tokenizer), rewards, tokenizer, max_new_tokens=self.max_new_tokens,
                             seed=self.seed, device=device, envs=self.envs, decode_compile=self.decode_compile)

    def build_workers(self, device: torch.device, tokenizer: Any, given: Mapping[str, torch.nn.Module] | None = None
                      ) -> dict[str, Any]:
        """Each role's model (with its optimizer) on `device`, in the order of `roles`. A module in
        `given` is that role's model as it is (a live policy, a service's shared base): only its
        optimizer comes from the spec; a `base_of` view runs the viewed role's module, given or built."""
        from rlgraph.backends.local.state import LMWorker

        given = dict(given or {})
        models = {}
        for role, spec in self.roles.items():
            if spec.base_of is None:
                # built on the CPU: the same weights on any device
                module = (given[role] if role in given else spec.build_module(tokenizer)).to(device)
                models[role] = LMWorker(module, spec.build_optimizer(module.parameters()), kind=spec.kind)
        for role, spec in self.roles.items():
            if spec.base_of is not None:
                from rlgraph.backends.lora import reference_of

                models[role] = LMWorker(reference_of(models[self.viewed(role)].model))
        return {role: models[role] for role in self.roles}

    def viewed(self, role: str) -> str:
        """The role whose module `role` (a `base_of` view) runs with adapters off, checked."""
        base = self.roles[role].base_of
        if base not in self.roles or self.roles[base].lora is None:
            raise ValueError(f"RoleSpec(base_of={base!r}) of role {role!r} needs a LoRA role {base!r} "
                             f"(the roles are {', '.join(self.roles)})")
        return base

    def views(self) -> dict[str, str]:
        """{role: the role whose module it runs with adapters off} for every `base_of` role, checked."""
        return {role: self.viewed(role) for role, spec in self.roles.items() if spec.base_of is not None}

    def controller(self) -> Any:
        """The controller's executor: reward functions and the tokenizer, no models."""
        from rlgraph.backends.local.executor import LocalExecutor, RewardWorker

        return LocalExecutor({}, {name: RewardWorker(fn) for name, fn in self.rewards.items()}, self.load_tokenizer(),
                             max_new_tokens=self.max_new_tokens, seed=self.seed)

    def build(self, rank: int, plan: Any, device: torch.device) -> Any:
        """Rank `rank`'s executor for `plan` (inside a torch.distributed job): see `rlgraph.backends.fsdp`."""
        from rlgraph.backends.fsdp.build import build_fsdp_executor

        return build_fsdp_executor(self, rank, plan, device)

    # The ranks' answers as whole values: only the backend that built the ranks knows their shard format.
    def merge_states(self, parts: Mapping[int, Any]) -> Any:
        """The full `ExecutorState` from every rank's `export_state()` part (rank -> part)."""
        from rlgraph.backends.fsdp.state import merge_rank_states

        return merge_rank_states(parts)

    def full_weights(self, role: str, parts: Mapping[int, Any]) -> dict[str, torch.Tensor]:
        """`role`'s full weights from every rank's `full_state(role)` answer (rank -> part)."""
        from rlgraph.backends.fsdp.state import full_weights

        return full_weights(role, parts)


def _decode_policy(value: Any) -> Any:
    from rlgraph.backends.local.decode_compile import DecodeCompile

    return DecodeCompile.of(value, "WorldSpec.decode_compile")


def _lora_roles(models: Mapping[str, Any]) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """The LoRA settings (plain data) of each LoRA role, and each adapters-off view's viewed role."""
    if "peft" not in sys.modules:  # no LoRA model exists before peft is imported (an optional dependency)
        return {}, {}
    from rlgraph.backends.lora import is_lora, settings_of, viewed_model

    lora = {role: attrs.asdict(settings_of(worker.model)) for role, worker in models.items() if is_lora(worker.model)}
    owners = {id(worker.model): role for role, worker in models.items()}
    views = {}
    for role, worker in models.items():
        viewed = viewed_model(worker.model)
        if viewed is not None:
            if id(viewed) not in owners:
                raise ValueError(f"role {role!r} is an adapters-off view of a model no role of the executor holds")
            views[role] = owners[id(viewed)]
    return lora, views
