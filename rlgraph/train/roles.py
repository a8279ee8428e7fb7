"""A run's roles as models: the policy (full or LoRA, from the model path, a checkpoint or a warm
start), the KL reference, the critic, their optimizers and the learning-rate schedule."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import torch

from rlgraph.backends.local.critic import build_critic
from rlgraph.backends.local.decode_compile import DecodeCompile
from rlgraph.backends.local.executor import CheckpointMismatch, LMWorker, LocalExecutor, RewardWorker
from rlgraph.backends.local.models import build_causal_lm
from rlgraph.train.checkpoint import BASE_FILE
from rlgraph.train.config import TrainConfig
from rlgraph.train.modes import follow_umask
from rlgraph.train.setup import Setup


# -- roles ----------------------------------------------------------------------------------------
def build_roles(setup: Setup, policy: torch.nn.Module | None = None) -> LocalExecutor:
    """The executor over the policy (`build_policy`'s, or the module given) and the rewards;
    `add_rl_roles` adds the reference and critic the plan reads."""
    config = setup.config
    model = (policy if policy is not None else build_policy(config, setup.tokenizer)).to(setup.device)
    policy = LMWorker(model, role_optimizer(config, model, config.optimizer.lr))
    common = dict(max_new_tokens=config.rollout.max_new_tokens, seed=config.train.seed, device=setup.device,
                  envs={"env": setup.env} if setup.env is not None else None, decode_compile=decode_policy(setup),
                  compile_train=compiles_training(config, str(setup.device)))
    if config.runtime.engine == "vllm":  # generation on vLLM; the plan's sync_weights steps fill its copy
        from rlgraph.backends.vllm.local import VLLMLocalExecutor, build_local_engine

        sizes = setup.rl.plan.sizes
        engine = build_local_engine(model, role="policy", tokenizer=setup.tokenizer, seed=config.train.seed,
                                    max_model_len=sizes["P"] + max(sizes["T"], eval_tokens(config)))
        return VLLMLocalExecutor({"policy": policy}, {"reward": RewardWorker(setup.rewards)}, setup.tokenizer,
                                 engine=engine, **common)
    return LocalExecutor({"policy": policy}, {"reward": RewardWorker(setup.rewards)}, setup.tokenizer, **common)


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




def build_policy(config: TrainConfig, tokenizer: Any) -> torch.nn.Module:
    """The policy as the run starts it: the model (seeded init for a config) and, with `model.lora`,
    its adapters (seeded too), so a run, its resume, its evaluation and its export build the same
    module. A LoRA run that warm-started keeps its merged base in RUN_DIR/base.safetensors: the
    adapters of its checkpoints apply to that base."""
    if config.vision is not None:  # a Qwen2-VL / Qwen2.5-VL (no LoRA: `check_vision`)
        from rlgraph.train.vision import build_vision_policy

        return build_vision_policy(config, tokenizer)
    model = build_causal_lm(config.model.path, tokenizer=tokenizer, seed=config.train.seed)
    if config.model.lora is None:
        return model
    from rlgraph.backends.lora import LoraSettings, apply_lora

    base = config.directory / BASE_FILE
    if base.is_file():
        from safetensors.torch import load_file

        from rlgraph.train.checkpoint import load_weights

        load_weights(model, load_file(str(base)), base, strict=True)
    lora = config.model.lora
    return apply_lora(model, LoraSettings(lora.r, lora.alpha, lora.dropout, tuple(lora.target_modules)),
                      seed=config.train.seed)


def checkpoint_policy(config: TrainConfig, tokenizer: Any, path: Path) -> tuple[torch.nn.Module, int]:
    """(the policy as the run built it, with checkpoint `path`'s weights; the checkpoint's step).
    A LoRA checkpoint holds the adapters only: the base comes from `build_policy`."""
    from rlgraph.backends.lora import is_lora
    from rlgraph.train.checkpoint import load_weights, read_checkpoint

    state, step, _ = read_checkpoint(path)
    if "policy" not in state.roles:
        raise CheckpointMismatch(f"checkpoint {path} has no policy role (it has {', '.join(state.roles)})")
    model = build_policy(config, tokenizer)
    load_weights(model, dict(state.roles["policy"].model), path, strict=not is_lora(model))
    return model, step


def rebase_lora(setup: Setup, executor: LocalExecutor) -> None:
    """After a LoRA warm start: merge the trained adapters into the base (saved once as
    RUN_DIR/base.safetensors, atomically) and start RL from fresh adapters on it, so the KL
    reference (the base, adapters off) is the warm-started policy, still with no second copy."""
    import os

    from safetensors.torch import save_file

    from rlgraph.backends.lora import merged_state_dict

    merged = {name: tensor.detach().to("cpu").contiguous().clone()
              for name, tensor in merged_state_dict(executor.models["policy"].model).items()}
    from rlgraph.train.checkpoint import claim_file
    from rlgraph.train.manifest import claim, release

    path = setup.config.directory / BASE_FILE
    tmp = path.with_name(path.name + ".tmp")
    claim(path.parent, tmp.name)
    save_file(merged, str(tmp))
    follow_umask(tmp)  # safetensors writes 0600: the run directory's one rule (rlgraph.train.modes)
    os.replace(tmp, path)
    release(path.parent, tmp.name)
    claim_file(path.parent, BASE_FILE)  # its sha256: every checkpoint records it, every read checks it
    model = build_policy(setup.config, setup.tokenizer).to(setup.device)
    executor.models["policy"] = LMWorker(model, role_optimizer(setup.config, model, setup.config.optimizer.lr))


def add_rl_roles(setup: Setup, executor: LocalExecutor) -> None:
    """The reference (the warm-started policy, frozen; with LoRA the base itself, adapters off) and
    PPO's critic (the warm-started backbone plus a value head; with LoRA the policy's merged
    weights, the critic itself trained in full), for the roles the plan reads."""
    config, roles = setup.config, {node.target for node in setup.rl.source.inputs}
    policy = executor.models["policy"].model
    if "ref" in roles:
        if config.model.lora is not None:
            from rlgraph.backends.lora import reference_of

            executor.models["ref"] = LMWorker(reference_of(policy))
        else:
            executor.models["ref"] = LMWorker(copy.deepcopy(policy).requires_grad_(False))
    if "critic" in roles:
        critic = build_critic(config.model.path, tokenizer=setup.tokenizer, seed=config.train.seed + 1).to(setup.device)
        if config.model.lora is not None:  # the critic trains in full, from the policy's merged weights
            from rlgraph.backends.lora import merged_state_dict

            critic.backbone.load_state_dict(merged_state_dict(policy))
        else:
            critic.backbone.load_state_dict(policy.state_dict())
        lr = config.optimizer.critic_lr or config.optimizer.lr
        executor.models["critic"] = LMWorker(critic, role_optimizer(config, critic, lr), kind="critic")
    for role in sorted(roles & set(config.model.teachers)):  # distillation's frozen teachers, from their directories
        from rlgraph.train.teachers import build_teacher

        executor.models[role] = build_teacher(config, role, setup.tokenizer, setup.device)


def role_optimizer(config: TrainConfig, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """The config's optimizer over the parameters that train (LoRA: the adapters only)."""
    from rlgraph.backends.world import make_optimizer

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
