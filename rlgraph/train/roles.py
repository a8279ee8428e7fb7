"""A run's roles as the config gives them: the policy's recipe (full or LoRA, from the model path,
a LoRA run's warm-started base or given start weights), the optimizer settings, the learning-rate
schedule, and the run's compile decisions (`generation.compile`, `train.compile`) for the
executors. `rlgraph.train.recipe` turns these into the `WorldSpec` every runtime builds from."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from rlgraph.backends.local.decode_compile import DecodeCompile
from rlgraph.backends.local.state import CheckpointMismatch
from rlgraph.backends.world import RoleSpec, make_optimizer
from rlgraph.train.checkpoint import BASE_FILE
from rlgraph.train.config import TrainConfig
from rlgraph.train.setup import Setup

# A start of the policy: a safetensors file of its weights, or the weights themselves (in memory).
Start = str | Path | Mapping[str, torch.Tensor] | None


# -- the policy -----------------------------------------------------------------------------------
def policy_spec(config: TrainConfig, *, start: Start = None, lr: float | None = None) -> RoleSpec:
    """The policy's recipe: `model.path` (seeded init for a config) and, with `model.lora`, its seeded
    adapters, so a run, its resume, its evaluation and its export build the same module. `start` is
    the policy's start weights (a warm start's: a file, or in memory); without it a LoRA run whose
    warm start left RUN_DIR/base.safetensors starts from that merged base (its checkpoints'
    adapters apply to it). `lr` replaces `optimizer.lr` (the warm start's)."""
    lora, base = config.model.lora, config.directory / BASE_FILE
    if start is None and lora is not None and base.is_file():
        start = base  # the plain merged base: the policy's adapters are drawn on it (seeded)
    adapters = None if lora is None else {"r": lora.r, "alpha": lora.alpha, "dropout": lora.dropout,
                                          "target_modules": tuple(lora.target_modules)}
    source, train_vision = config.model.path, False
    if config.vision is not None:  # a Qwen2-VL / Qwen2.5-VL: null is the shipped tiny one (LoRA: on its language model)
        from rlgraph.backends.local.vlm import TINY_VL_CONFIG

        source, train_vision = source or str(TINY_VL_CONFIG), config.vision.train_tower
    return RoleSpec(source=source, **start_weights(start), optimizer=config.optimizer.name,
                    lr=config.optimizer.lr if lr is None else lr, seed=config.train.seed,
                    optimizer_options=optimizer_options(config), lora=adapters, train_vision=train_vision)


def start_weights(start: Start) -> dict[str, Any]:
    """A `RoleSpec`'s start-up weights: a file (by its absolute path: the workers read it) or a state dict."""
    if start is None:
        return {}
    if isinstance(start, Mapping):
        return {"weights": start}
    return {"weights_file": str(Path(start).resolve())}


def build_policy(config: TrainConfig, tokenizer: Any) -> torch.nn.Module:
    """The policy as the run starts it (`policy_spec`'s module, on the CPU)."""
    return policy_spec(config).build_module(tokenizer)


def checkpoint_policy(config: TrainConfig, tokenizer: Any, path: Path) -> tuple[torch.nn.Module, int]:
    """(the policy as the run built it, with checkpoint `path`'s weights; the checkpoint's step).
    A LoRA checkpoint holds the adapters only: the base comes from `build_policy`."""
    from rlgraph.train.checkpoint import load_weights, read_checkpoint

    state, step, _ = read_checkpoint(path)
    if "policy" not in state.roles:
        raise CheckpointMismatch(f"checkpoint {path} has no policy role (it has {', '.join(state.roles)})")
    model = build_policy(config, tokenizer)
    # A role with frozen parameters (LoRA's base, a VLM's frozen tower) checkpoints only its trainable
    # ones (`checkpoint_weights`); the frozen ones come from the model source, as the run built them.
    frozen = any(not param.requires_grad for param in model.parameters())
    load_weights(model, dict(state.roles["policy"].model), path, strict=not frozen)
    return model, step


# -- optimizers, schedule, compile decisions -------------------------------------------------
def role_optimizer(config: TrainConfig, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """The config's optimizer over the parameters that train (LoRA: the adapters only)."""
    return make_optimizer(config.optimizer.name, model.parameters(), lr, **optimizer_options(config))


def optimizer_options(config: TrainConfig) -> dict[str, Any]:
    """The optimizer's keyword arguments besides the learning rate (the workers' `RoleSpec` gets the same)."""
    opt = config.optimizer
    return {"weight_decay": opt.weight_decay} if opt.name == "sgd" else {"betas": tuple(opt.betas), "weight_decay": opt.weight_decay}


def lr_factor(config: TrainConfig, step: int) -> float:
    """The schedule's multiplier of `optimizer.lr` at RL step `step` (0-based): linear warmup, then
    constant, linear or cosine decay to `min_lr_ratio` at `train.steps` (a time-bound run stays constant)."""
    opt, total = config.optimizer, config.train.steps
    if step < opt.warmup_steps:
        return (step + 1) / (opt.warmup_steps + 1)
    if opt.schedule == "constant" or total is None or total <= opt.warmup_steps:
        return 1.0
    progress = min((step - opt.warmup_steps) / max(total - opt.warmup_steps, 1), 1.0)
    shape = 1.0 - progress if opt.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return opt.min_lr_ratio + (1.0 - opt.min_lr_ratio) * shape


def eval_tokens(config: TrainConfig) -> int:
    """The response tokens of an evaluation (`eval.max_new_tokens`, else the rollout's)."""
    return config.eval.max_new_tokens or config.rollout.max_new_tokens


def decode_policy(setup: Setup) -> DecodeCompile:
    """`generation.compile` for this run. For auto, the generate calls it projects per number of rows
    of one generation replica (a spmd/ray rank generates its share: B x n / replicas rows): one a
    step of the rollout's rows, and the evaluations of the held-out prompts (before RL, every
    `eval.every` steps, at the end); a run bounded by `train.seconds` alone projects no steps.
    Prompts are padded to the run's longest (the plan's P), so each number of rows is one shape."""
    config = setup.config
    steps, rollout = config.train.steps or 0, config.rollout
    replicas = generation_replicas(setup.rl.plan)
    calls = {-(-rollout.prompts_per_step * rollout.n // replicas): steps}
    if setup.eval_rows:
        evaluations = 2 + (steps // config.eval.every if config.eval.every else 0)
        rows = -(-len(setup.eval_rows) // replicas)
        calls[rows] = calls.get(rows, 0) + evaluations
    return DecodeCompile(config.generation.compile, calls=calls, width=setup.rl.plan.sizes.get("P"))


def generation_replicas(plan: Any) -> int:
    """How many ways the plan splits a generate call's rows (the generating group's replicas)."""
    return max((group.generate.dp for group in plan.groups if group.generate is not None), default=1)


def compiles_training(config: TrainConfig, device: str) -> bool:
    """`train.compile` resolved for this run (`rlgraph.backends.local.train_compile`): `auto` counts
    the micro-batch forwards the run trains: train.steps x epochs x micro-batches a step (rows /
    micro_batch_size; rows x max_new_tokens / train.micro_batch_tokens, a lower bound; else one).
    `on` is refused off the local runtime: FSDP2 under torch.compile is untested."""
    from rlgraph.backends.local.train_compile import resolve_train_compile
    from rlgraph.errors import ConfigError

    mode, hparams, rollout = config.train.compile, config.algorithm.hparams, config.rollout
    if mode == "on" and config.runtime.runtime != "local":
        raise ConfigError(f"train.compile=on with runtime.runtime={config.runtime.runtime}: the compiled training "
                          "forward runs on the local runtime only (FSDP2 under torch.compile is untested)",
                          fix="train.compile=off (or auto), or runtime.runtime=local")
    rows = rollout.prompts_per_step * rollout.n
    if hparams.get("micro_batch_size"):
        micro = -(-rows // int(hparams["micro_batch_size"]))
    elif config.train.micro_batch_tokens:
        micro = -(-rows * rollout.max_new_tokens // config.train.micro_batch_tokens)
    else:
        micro = 1
    forwards = None if config.train.steps is None else config.train.steps * int(hparams.get("epochs", 1)) * micro
    return config.runtime.runtime == "local" and resolve_train_compile(mode, device, forwards)
